//! The MoE layer: router, capacity, the expert MLPs, and the exchange,
//! forward and backward over flat parameter buffers ([`MoeLayout`]).
//!
//! [`MoeLayer`] is the single-process layer (ep = 1: every collective is a
//! copy); [`EpMoeLayer`] runs the same code with the collectives over an
//! EP [`ProcessGroup`], each rank holding its own slice of the batch
//! (data parallel over the EP group) and E / ep experts. The router is
//! replicated; its gradient is summed over the group.
//!
//! Each expert is GPT-2's MLP: `ye = fcp(gelu(fc(xe)))`, fc (F, C) + (F),
//! fcp (C, F) + (C), GELU the exact (erf) one.
//!
//! The objective the backward differentiates is the caller's loss through
//! `y` plus `aux_weight · aux` (see the module doc of [`crate::expert`]).
use super::dispatch::{
    EpComm, Exchange, LocalComm, count_slots, gather_rows, local_counts, scatter_rows,
};
use super::gate::{
    aux_loss, aux_loss_bwd, prob_sums, softmax_bwd, softmax_fwd, top_k_bwd, top_k_fwd,
};
use super::{MoeConfig, MoeLayout, MoeStats, check_len};
use crate::error::{Result, TrainError};
use comm::dtype::Element;
use comm::group::ProcessGroup;
use model::kernels::activation::{GeluKind, gelu_bwd, gelu_fwd};
use model::kernels::matmul::{matmul_bwd_input, matmul_bwd_weight, matmul_fwd};
use model::{Real, Threads};

const GELU: GeluKind = GeluKind::Erf;

// ----------------------------------------------------------------------------
// one expert

/// One expert's four tensors, in buffer order: fc_w (F, C), fc_b (F),
/// fcp_w (C, F), fcp_b (C).
fn split4<T>(p: &mut [T], c: usize, f: usize) -> [&mut [T]; 4] {
    let (fc_w, rest) = p.split_at_mut(f * c);
    let (fc_b, rest) = rest.split_at_mut(f);
    let (fcp_w, fcp_b) = rest.split_at_mut(c * f);
    [fc_w, fc_b, fcp_w, fcp_b]
}

/// Expert forward over `r` rows: `h = xe · fc_wᵀ + fc_b`, `act = gelu(h)`,
/// `ye = act · fcp_wᵀ + fcp_b`.
///
/// ye: (r, C), h, act: (r, F), xe: (r, C), p: one expert's parameters.
// Kernels take explicit buffers and sizes (llm.c's convention, as in the
// model crate), so the long argument lists are the design.
#[allow(clippy::too_many_arguments)]
fn expert_fwd<T: Real>(
    th: &Threads,
    ye: &mut [T],
    h: &mut [T],
    act: &mut [T],
    xe: &[T],
    p: &[T],
    r: usize,
    c: usize,
    f: usize,
) {
    let (fc_w, rest) = p.split_at(f * c);
    let (fc_b, rest) = rest.split_at(f);
    let (fcp_w, fcp_b) = rest.split_at(c * f);
    matmul_fwd(th, h, xe, fc_w, Some(fc_b), r, c, f);
    gelu_fwd(th, act, h, GELU);
    matmul_fwd(th, ye, act, fcp_w, Some(fcp_b), r, f, c);
}

/// Expert backward over `r` rows: overwrites `dxe`, accumulates (`+=`) the
/// expert's parameter gradients into `g`.
///
/// In the forward `ye = act · fcp_wᵀ + fcp_b` and `h = xe · fc_wᵀ + fc_b`, so
/// `dact = dye · fcp_w`, `dh = dact ⊙ gelu'(h)`, `dxe = dh · fc_w`.
///
/// dxe: (r, C), g: one expert's gradients, dye: (r, C), xe: (r, C),
/// h, act: (r, F), p: the expert's parameters.
#[allow(clippy::too_many_arguments)]
fn expert_bwd<T: Real>(
    th: &Threads,
    dxe: &mut [T],
    g: &mut [T],
    dye: &[T],
    xe: &[T],
    h: &[T],
    act: &[T],
    p: &[T],
    r: usize,
    c: usize,
    f: usize,
) {
    let fc_w = &p[..f * c];
    let fcp_w = &p[f * c + f..f * c + f + c * f];
    let [g_fc_w, g_fc_b, g_fcp_w, g_fcp_b] = split4(g, c, f);
    let mut dact = vec![T::zero(); r * f];
    matmul_bwd_input(th, &mut dact, T::zero(), dye, fcp_w, r, f, c);
    matmul_bwd_weight(th, g_fcp_w, Some(g_fcp_b), dye, act, r, f, c);
    let mut dh = vec![T::zero(); r * f];
    gelu_bwd(th, &mut dh, h, &dact, GELU);
    matmul_bwd_input(th, dxe, T::zero(), &dh, fc_w, r, c, f);
    matmul_bwd_weight(th, g_fc_w, Some(g_fc_b), &dh, xe, r, c, f);
}

// ----------------------------------------------------------------------------
// the layer, generic over the EP collectives

/// What the backward needs from the forward.
#[derive(Debug, Default)]
struct Cache<T> {
    /// N, tokens on this rank.
    n: usize,
    /// (N, C) the input.
    x: Vec<T>,
    /// (N, E) router probabilities.
    probs: Vec<T>,
    /// (N, k) chosen experts.
    choice: Vec<usize>,
    /// (N, k) gate weights.
    gate: Vec<T>,
    /// The routing plan (and the global counts in its stats).
    ex: Exchange,
    /// (R, C) expert inputs, expert-major.
    xe: Vec<T>,
    /// (R, F) expert pre-activations.
    h: Vec<T>,
    /// (R, F) expert activations.
    act: Vec<T>,
    /// (S, C) expert outputs back at the source, in send order.
    ye_back: Vec<T>,
}

#[derive(Debug)]
struct Core<T> {
    layout: MoeLayout,
    cache: Option<Cache<T>>,
}

fn rows_to_elems(rows: &[usize], c: usize) -> Vec<usize> {
    rows.iter().map(|&r| r * c).collect()
}

impl<T: Real> Core<T> {
    fn forward<M: EpComm<T>>(
        &mut self,
        comm: &mut M,
        th: &Threads,
        params: &[T],
        x: &[T],
    ) -> Result<(Vec<T>, MoeStats)> {
        self.cache = None;
        let l = &self.layout;
        let cfg = l.cfg;
        let (c, f, e, k) = (cfg.channels, cfg.hidden, cfg.experts, cfg.top_k);
        check_len("moe parameters", l.len(), params.len())?;
        if !x.len().is_multiple_of(c) {
            return Err(TrainError::Config {
                field: "x",
                value: format!("{} elements", x.len()),
                reason: format!("must be (N, C) with C = {c}"),
            });
        }
        let n = x.len() / c;

        // Router: logits = x · Wgᵀ, softmax, top-k.
        let mut logits = vec![T::zero(); n * e];
        matmul_fwd(th, &mut logits, x, &params[l.router()], None, n, c, e);
        let mut probs = vec![T::zero(); n * e];
        softmax_fwd(&mut probs, &logits, n, e);
        let mut choice = vec![0usize; n * k];
        let mut gate = vec![T::zero(); n * k];
        top_k_fwd(&mut choice, &mut gate, &probs, n, e, k);

        // Counts first: every rank learns the (ep, E) matrix and N_global.
        let ep = comm.size();
        let mine = local_counts(&cfg, &choice, n);
        let mut all = vec![0i64; ep * count_slots(&cfg)];
        comm.all_gather_i64(&mine, &mut all)?;
        let mut ex = Exchange::plan(&cfg, &all, comm.rank(), &choice, n)?;

        // Aux loss over the whole group: P_e needs the summed probabilities.
        let mut psum = vec![T::zero(); e];
        prob_sums(&mut psum, &probs, n, e);
        comm.all_reduce_sum(&mut psum)?;
        ex.stats.aux_loss = aux_loss(&ex.stats.routed, &psum, ex.stats.tokens, k)
            .to_f64()
            .unwrap_or(f64::NAN);
        let mut dropped = [ex.stats.dropped_tokens as i64];
        comm.all_reduce_sum_i64(&mut dropped)?;
        ex.stats.dropped_tokens = dropped[0].max(0) as usize;

        // Dispatch: token rows in send order, to the experts' ranks.
        let tokens: Vec<usize> = ex.send.iter().map(|&a| a / k).collect();
        let mut xs = vec![T::zero(); tokens.len() * c];
        gather_rows(&mut xs, x, &tokens, c);
        let (send_el, recv_el) = (
            rows_to_elems(&ex.send_rows, c),
            rows_to_elems(&ex.recv_rows, c),
        );
        let r_all = ex.perm.len();
        let mut recv = vec![T::zero(); r_all * c];
        comm.all_to_all_v(&xs, &send_el, &mut recv, &recv_el)?;
        let mut xe = vec![T::zero(); r_all * c];
        gather_rows(&mut xe, &recv, &ex.perm, c);

        // Experts, each on its consecutive block of rows.
        let (mut h, mut act, mut ye) = (
            vec![T::zero(); r_all * f],
            vec![T::zero(); r_all * f],
            vec![T::zero(); r_all * c],
        );
        let mut row = 0;
        for (le, &r) in ex.expert_rows.iter().enumerate() {
            if r > 0 {
                let (cr, fr) = (row * c..(row + r) * c, row * f..(row + r) * f);
                expert_fwd(
                    th,
                    &mut ye[cr.clone()],
                    &mut h[fr.clone()],
                    &mut act[fr],
                    &xe[cr],
                    &params[l.expert(le)],
                    r,
                    c,
                    f,
                );
            }
            row += r;
        }

        // Combine: back to the sources, then y[t] = Σ_j gate[t, j] · ye[t, j].
        scatter_rows(&mut recv, &ye, &ex.perm, c);
        let mut ye_back = vec![T::zero(); xs.len()];
        comm.all_to_all_v(&recv, &recv_el, &mut ye_back, &send_el)?;
        let mut y = vec![T::zero(); n * c];
        for (i, &a) in ex.send.iter().enumerate() {
            let (t, g) = (a / k, gate[a]);
            for (o, &v) in y[t * c..(t + 1) * c]
                .iter_mut()
                .zip(&ye_back[i * c..(i + 1) * c])
            {
                *o += g * v;
            }
        }

        let sz = std::mem::size_of::<T>();
        let me = comm.rank();
        ex.stats.a2a_bytes = (tokens.len() + r_all) * c * sz;
        ex.stats.a2a_bytes_off_rank =
            (tokens.len() - ex.send_rows[me] + r_all - ex.recv_rows[me]) * c * sz;
        let stats = ex.stats.clone();
        self.cache = Some(Cache {
            n,
            x: x.to_vec(),
            probs,
            choice,
            gate,
            ex,
            xe,
            h,
            act,
            ye_back,
        });
        Ok((y, stats))
    }

    fn backward<M: EpComm<T>>(
        &mut self,
        comm: &mut M,
        th: &Threads,
        params: &[T],
        grads: &mut [T],
        dy: &[T],
    ) -> Result<Vec<T>> {
        let l = &self.layout;
        let cfg = l.cfg;
        let (c, f, e, k) = (cfg.channels, cfg.hidden, cfg.experts, cfg.top_k);
        let Some(cache) = self.cache.as_ref() else {
            return Err(TrainError::Config {
                field: "backward",
                value: "no forward".into(),
                reason: "the MoE backward needs the forward's activations; call forward first"
                    .into(),
            });
        };
        check_len("moe parameters", l.len(), params.len())?;
        check_len("moe gradients", l.len(), grads.len())?;
        let n = cache.n;
        check_len("moe dy (N, C)", n * c, dy.len())?;
        let ex = &cache.ex;

        // In the forward y[t] += g · ye_i, so dye_i = g · dy[t], dg = dy[t] · ye_i.
        let s_all = ex.send.len();
        let mut dys = vec![T::zero(); s_all * c];
        let mut dgate = vec![T::zero(); n * k];
        for (i, &a) in ex.send.iter().enumerate() {
            let (t, g) = (a / k, cache.gate[a]);
            let (d, yb) = (&dy[t * c..(t + 1) * c], &cache.ye_back[i * c..(i + 1) * c]);
            for (o, &v) in dys[i * c..(i + 1) * c].iter_mut().zip(d) {
                *o = g * v;
            }
            dgate[a] = d.iter().zip(yb).map(|(&p, &q)| p * q).sum();
        }

        // Expert-output gradients go where the experts are (dispatch counts).
        let (send_el, recv_el) = (
            rows_to_elems(&ex.send_rows, c),
            rows_to_elems(&ex.recv_rows, c),
        );
        let r_all = ex.perm.len();
        let mut recv = vec![T::zero(); r_all * c];
        comm.all_to_all_v(&dys, &send_el, &mut recv, &recv_el)?;
        let mut dye = vec![T::zero(); r_all * c];
        gather_rows(&mut dye, &recv, &ex.perm, c);
        let mut dxe = vec![T::zero(); r_all * c];
        let mut row = 0;
        for (le, &r) in ex.expert_rows.iter().enumerate() {
            if r > 0 {
                let (cr, fr) = (row * c..(row + r) * c, row * f..(row + r) * f);
                expert_bwd(
                    th,
                    &mut dxe[cr.clone()],
                    &mut grads[l.expert(le)],
                    &dye[cr.clone()],
                    &cache.xe[cr],
                    &cache.h[fr.clone()],
                    &cache.act[fr],
                    &params[l.expert(le)],
                    r,
                    c,
                    f,
                );
            }
            row += r;
        }
        // Input gradients back to the sources (combine counts).
        scatter_rows(&mut recv, &dxe, &ex.perm, c);
        let mut dx_back = vec![T::zero(); s_all * c];
        comm.all_to_all_v(&recv, &recv_el, &mut dx_back, &send_el)?;

        // Router: gate and aux backward into dprobs, then softmax, then linear.
        let mut dprobs = vec![T::zero(); n * e];
        top_k_bwd(&mut dprobs, &dgate, &cache.choice, &cache.probs, n, e, k);
        let st = &ex.stats;
        aux_loss_bwd(
            &mut dprobs,
            &st.routed,
            st.tokens,
            k,
            T::of(cfg.aux_weight),
            n,
        );
        let mut dlogits = vec![T::zero(); n * e];
        softmax_bwd(&mut dlogits, &dprobs, &cache.probs, n, e);
        let mut dx = vec![T::zero(); n * c];
        matmul_bwd_input(
            th,
            &mut dx,
            T::zero(),
            &dlogits,
            &params[l.router()],
            n,
            c,
            e,
        );
        for (i, &a) in ex.send.iter().enumerate() {
            let t = a / k;
            for (o, &v) in dx[t * c..(t + 1) * c]
                .iter_mut()
                .zip(&dx_back[i * c..(i + 1) * c])
            {
                *o += v;
            }
        }
        // The router is replicated and each rank saw its own tokens: sum.
        let mut gw = vec![T::zero(); e * c];
        if n > 0 {
            matmul_bwd_weight(th, &mut gw, None, &dlogits, &cache.x, n, c, e);
        }
        comm.all_reduce_sum(&mut gw)?;
        for (g, &v) in grads[l.router()].iter_mut().zip(&gw) {
            *g += v;
        }
        Ok(dx)
    }
}

// ----------------------------------------------------------------------------
// public layers

/// The single-process MoE layer (ep = 1): all E experts, all N tokens.
#[derive(Debug)]
pub struct MoeLayer<T> {
    core: Core<T>,
}

impl<T: Real> MoeLayer<T> {
    /// A layer of `cfg` (validated).
    pub fn new(cfg: MoeConfig) -> Result<Self> {
        Ok(Self {
            core: Core {
                layout: MoeLayout::new(cfg, 1, 0)?,
                cache: None,
            },
        })
    }

    /// Where the parameters lie; `layout().len()` is the buffer length.
    pub fn layout(&self) -> &MoeLayout {
        &self.core.layout
    }

    /// Forward: y (N, C) from x (N, C) with `params` ([`MoeLayout`]), and
    /// the routing metrics (aux loss included). Keeps the activations for
    /// [`backward`](Self::backward).
    pub fn forward(&mut self, th: &Threads, params: &[T], x: &[T]) -> Result<(Vec<T>, MoeStats)> {
        self.core.forward(&mut LocalComm, th, params, x)
    }

    /// Backward of the last forward: returns dx (N, C) and accumulates
    /// (`+=`) the parameter gradients of `Σ dy ⊙ y + aux_weight · aux` into
    /// `grads` (same layout as `params`).
    pub fn backward(
        &mut self,
        th: &Threads,
        params: &[T],
        grads: &mut [T],
        dy: &[T],
    ) -> Result<Vec<T>> {
        self.core.backward(&mut LocalComm, th, params, grads, dy)
    }
}

/// The expert-parallel MoE layer: one rank of an EP group. The rank routes
/// its own N tokens (its slice of the batch), holds the router and its
/// E / ep experts ([`MoeLayout`] with this rank), and exchanges rows with
/// the other ranks through all-to-alls (see [`crate::expert::dispatch`]).
pub struct EpMoeLayer<T> {
    core: Core<T>,
    group: ProcessGroup,
}

impl<T> std::fmt::Debug for EpMoeLayer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpMoeLayer")
            .field("layout", &self.core.layout)
            .field("group", &self.group.name())
            .field("rank", &self.group.rank())
            .finish()
    }
}

impl<T: Real + Element> EpMoeLayer<T> {
    /// This rank's layer of `cfg` over the EP `group`; refuses a group size
    /// that does not divide E (naming `experts` and the equation).
    pub fn new(cfg: MoeConfig, group: ProcessGroup) -> Result<Self> {
        let layout = MoeLayout::new(cfg, group.size(), group.rank())?;
        Ok(Self {
            core: Core {
                layout,
                cache: None,
            },
            group,
        })
    }

    /// This rank's parameter layout.
    pub fn layout(&self) -> &MoeLayout {
        &self.core.layout
    }

    /// Forward of this rank's tokens: y (N, C) from x (N, C), and the
    /// group-wide routing metrics (byte counts are this rank's). Every rank
    /// of the group must call it (collective).
    pub fn forward(&mut self, th: &Threads, params: &[T], x: &[T]) -> Result<(Vec<T>, MoeStats)> {
        let mut g = &self.group;
        self.core.forward(&mut g, th, params, x)
    }

    /// Backward of the last forward (collective): returns dx (N, C) and
    /// accumulates into `grads` the router gradient summed over the group
    /// and this rank's experts' gradients from every rank's tokens.
    pub fn backward(
        &mut self,
        th: &Threads,
        params: &[T],
        grads: &mut [T],
        dy: &[T],
    ) -> Result<Vec<T>> {
        let mut g = &self.group;
        self.core.backward(&mut g, th, params, grads, dy)
    }
}
