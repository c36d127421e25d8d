//! The MoE feed-forward: router, capacity, the expert MLPs and the exchange, forward and
//! backward over one rank's flat parameter buffer ([`MoeLayout`]).
//!
//! One rank of an EP group routes its own N tokens (its slice of the batch), holds the router
//! and its El = E / ep experts, and exchanges rows with the other ranks through
//! [`ExpertComm`]'s all-to-alls (see [`super::dispatch`]); with [`super::Local`] (ep = 1) every
//! exchange is a copy. The router is replicated.
//!
//! Each expert is the block's MLP: `ye = fcp(act(fc(xe)))` with the block's activation (GELU,
//! tanh-GELU or SwiGLU), fc (Fin, C) (+ Fin), fcp (C, F) (+ C).
use super::dispatch::{Exchange, ExpertComm, count_slots, gather_rows, local_counts, scatter_rows};
use super::gate::{
    aux_loss, aux_loss_bwd, prob_sums, softmax_bwd, softmax_fwd, top_k_bwd, top_k_fwd,
};
use super::{ExpertParams, MoeConfig, MoeLayout, MoeStats, check_len};
use crate::error::{ModelError, Result};
use crate::kernels::activation::{ffn_act_bwd, ffn_act_fwd};
use crate::kernels::matmul::{matmul_bwd_input, matmul_bwd_weight, matmul_fwd};
use crate::real::Real;
use crate::threads::Threads;

/// Which objective the backward differentiates, i.e. how the ranks' gradients combine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Objective {
    /// The layer on its own: `Σ_ranks (the caller's loss through y) + aux_weight · aux`. The
    /// router's gradient is summed over the EP group inside the backward (every rank ends with
    /// the same), each expert's comes from every rank's tokens.
    #[default]
    Sum,
    /// One data-parallel replica's share of the mean over the ranks, as a block of the model:
    /// the gradients a data-parallel mean (over the replicas holding the same tensors) turns
    /// into those of `mean_ranks (the caller's loss) + aux_weight · aux`. So the router's
    /// gradient stays this rank's own (the replicas' mean sums it), each expert's is divided by
    /// ep (every rank's tokens reached it, each loss already a rank's mean), and the aux term
    /// is weighted by ep · aux_weight (the mean divides it by ep again).
    Mean,
}

/// One expert's forward over `r` rows: `h = xe · fc_wᵀ (+ fc_b)`, `act = act(h)`,
/// `ye = act · fcp_wᵀ (+ fcp_b)`.
///
/// ye: (r, C), h: (r, Fin), act: (r, F), xe: (r, C), p: the expert's parameters.
fn expert_fwd<T: Real>(
    th: &Threads,
    cfg: &MoeConfig,
    e: &ExpertParams,
    (ye, h, act): (&mut [T], &mut [T], &mut [T]),
    xe: &[T],
    p: &[T],
    r: usize,
) {
    let (c, f, fin) = (cfg.channels, cfg.hidden, cfg.hidden_in());
    let b = |x: &Option<std::ops::Range<usize>>| x.as_ref().map(|x| &p[x.clone()]);
    matmul_fwd(th, h, xe, &p[e.fc_w.clone()], b(&e.fc_b), r, c, fin);
    ffn_act_fwd(th, act, h, cfg.activation, r, f);
    matmul_fwd(th, ye, act, &p[e.fcp_w.clone()], b(&e.fcp_b), r, f, c);
}

/// One expert's backward over `r` rows: overwrites `dxe`, accumulates `scale ·` the expert's
/// parameter gradients into `g`.
///
/// dxe: (r, C), g: the expert's gradients, dye: (r, C), xe: (r, C), h: (r, Fin), act: (r, F).
#[allow(clippy::too_many_arguments)]
fn expert_bwd<T: Real>(
    th: &Threads,
    cfg: &MoeConfig,
    e: &ExpertParams,
    dxe: &mut [T],
    g: &mut [T],
    dye: &[T],
    (xe, h, act): (&[T], &[T], &[T]),
    p: &[T],
    r: usize,
    scale: T,
) {
    let (c, f, fin) = (cfg.channels, cfg.hidden, cfg.hidden_in());
    let mut dact = vec![T::zero(); r * f];
    matmul_bwd_input(th, &mut dact, T::zero(), dye, &p[e.fcp_w.clone()], r, f, c);
    let mut dh = vec![T::zero(); r * fin];
    ffn_act_bwd(th, &mut dh, &dact, h, cfg.activation, r, f);
    matmul_bwd_input(th, dxe, T::zero(), &dh, &p[e.fc_w.clone()], r, c, fin);
    // The weight gradients are linear in the output gradients: scaling those (dh in place, now
    // that dxe is done; dye in a copy) scales what accumulates into g.
    let scaled_dye;
    let dye = if scale == T::one() {
        dye
    } else {
        dh.iter_mut().for_each(|x| *x *= scale);
        scaled_dye = dye.iter().map(|&x| x * scale).collect::<Vec<T>>();
        &scaled_dye[..]
    };
    let mut grads = |dout: &[T],
                     inp: &[T],
                     w: &std::ops::Range<usize>,
                     bias: &Option<std::ops::Range<usize>>,
                     (ic, oc): (usize, usize)| {
        let (gw, gb) = split_bias(g, w, bias);
        matmul_bwd_weight(th, gw, gb, dout, inp, r, ic, oc);
    };
    grads(dye, act, &e.fcp_w, &e.fcp_b, (f, c));
    grads(&dh, xe, &e.fc_w, &e.fc_b, (c, fin));
}

/// Disjoint views of a weight at `w` and its optional bias at `b` in `g`.
fn split_bias<'a, T>(
    g: &'a mut [T],
    w: &std::ops::Range<usize>,
    b: &Option<std::ops::Range<usize>>,
) -> (&'a mut [T], Option<&'a mut [T]>) {
    match b {
        Some(b) => {
            let [gw, gb] = g
                .get_disjoint_mut([w.clone(), b.clone()])
                .expect("expert tensors are disjoint");
            (gw, Some(gb))
        }
        None => (&mut g[w.clone()], None),
    }
}

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
    /// (R, Fin) expert pre-activations.
    h: Vec<T>,
    /// (R, F) expert activations.
    act: Vec<T>,
    /// (S, C) expert outputs back at the source, in send order.
    ye_back: Vec<T>,
}

/// One rank's MoE feed-forward with the activations of its last forward.
#[derive(Debug)]
pub struct Experts<T> {
    layout: MoeLayout,
    objective: Objective,
    cache: Option<Cache<T>>,
}

impl<T> Experts<T> {
    /// The routing metrics of the last forward (None before one).
    pub fn stats(&self) -> Option<&MoeStats> {
        self.cache.as_ref().map(|c| &c.ex.stats)
    }
}

/// The element ranges of rows `row..row + r` in buffers (R, C), (R, Fin) and (R, F).
fn rows(row: usize, r: usize, (c, fin, f): (usize, usize, usize)) -> [std::ops::Range<usize>; 3] {
    [
        row * c..(row + r) * c,
        row * fin..(row + r) * fin,
        row * f..(row + r) * f,
    ]
}

fn rows_to_elems(rows: &[usize], c: usize) -> Vec<usize> {
    rows.iter().map(|&r| r * c).collect()
}

impl<T: Real> Experts<T> {
    /// Rank `rank` of an `ep`-way group's layer of `cfg` (refuses ep not dividing E, naming
    /// `experts` and the equation), its backward differentiating `objective`.
    pub fn new(cfg: MoeConfig, (ep, rank): (usize, usize), objective: Objective) -> Result<Self> {
        Ok(Self {
            layout: MoeLayout::new(cfg, ep, rank)?,
            objective,
            cache: None,
        })
    }

    /// This rank's parameter layout; `layout().len()` is the buffer length.
    pub fn layout(&self) -> &MoeLayout {
        &self.layout
    }

    /// Bytes the last forward keeps for the backward.
    pub fn cached_bytes(&self) -> usize {
        let sz = std::mem::size_of::<T>();
        self.cache.as_ref().map_or(0, |c| {
            (c.x.len() + c.probs.len() + c.gate.len() + c.xe.len())
                .saturating_add(c.h.len() + c.act.len() + c.ye_back.len())
                * sz
        })
    }

    /// Forward of this rank's tokens (collective over `comm`'s group): `y` (N, C) from `x`
    /// (N, C) with `params` ([`MoeLayout`]), and the group-wide routing metrics (byte counts
    /// this rank's). Keeps the activations for [`Experts::backward`].
    ///
    /// # Errors
    /// A shape error for `x` not (N, C) or `params` of the wrong length; a config error when
    /// a rank of the group was built with other settings; what `comm` returns.
    pub fn forward(
        &mut self,
        comm: &mut dyn ExpertComm<T>,
        th: &Threads,
        params: &[T],
        x: &[T],
    ) -> Result<(Vec<T>, MoeStats)> {
        self.cache = None;
        let l = &self.layout;
        let cfg = l.cfg;
        let (c, f, e, k) = (cfg.channels, cfg.hidden, cfg.experts, cfg.top_k);
        let fin = cfg.hidden_in();
        check_len("moe parameters", l.len(), params.len())?;
        if !x.len().is_multiple_of(c) {
            return Err(ModelError::Config {
                field: "x",
                value: format!("{} elements", x.len()),
                reason: format!("must be (N, C) with C = {c}"),
            });
        }
        let n = x.len() / c;
        if comm.size() != l.ep {
            return Err(ModelError::Config {
                field: "expert group",
                value: format!("{} ranks", comm.size()),
                reason: format!("the layer was built for ep = {} ranks", l.ep),
            });
        }

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
            vec![T::zero(); r_all * fin],
            vec![T::zero(); r_all * f],
            vec![T::zero(); r_all * c],
        );
        let ep_params = l.expert_params();
        let mut row = 0;
        for (le, &r) in ex.expert_rows.iter().enumerate() {
            if r > 0 {
                let [cr, hr, fr] = rows(row, r, (c, fin, f));
                let out = (&mut ye[cr.clone()], &mut h[hr], &mut act[fr]);
                expert_fwd(th, &cfg, &ep_params, out, &xe[cr], &params[l.expert(le)], r);
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

    /// Backward of the last forward (collective, same group and `params`): returns dx (N, C)
    /// and accumulates (`+=`) the parameter gradients of the [`Objective`] into `grads` (same
    /// layout as `params`).
    ///
    /// # Errors
    /// A config error without a forward; shape errors for `grads` or `dy`; what `comm`
    /// returns.
    pub fn backward(
        &self,
        comm: &mut dyn ExpertComm<T>,
        th: &Threads,
        params: &[T],
        grads: &mut [T],
        dy: &[T],
    ) -> Result<Vec<T>> {
        let l = &self.layout;
        let cfg = l.cfg;
        let (c, e, k) = (cfg.channels, cfg.experts, cfg.top_k);
        let (f, fin) = (cfg.hidden, cfg.hidden_in());
        let Some(cache) = self.cache.as_ref() else {
            return Err(ModelError::Config {
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
        let ep = comm.size();
        let (expert_scale, aux_weight) = match self.objective {
            Objective::Sum => (T::one(), cfg.aux_weight),
            Objective::Mean => (T::of(1.0 / ep as f64), cfg.aux_weight * ep as f64),
        };

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
        let ep_params = l.expert_params();
        let mut row = 0;
        for (le, &r) in ex.expert_rows.iter().enumerate() {
            if r > 0 {
                let [cr, hr, fr] = rows(row, r, (c, fin, f));
                let saved = (&cache.xe[cr.clone()], &cache.h[hr], &cache.act[fr]);
                expert_bwd(
                    th,
                    &cfg,
                    &ep_params,
                    &mut dxe[cr.clone()],
                    &mut grads[l.expert(le)],
                    &dye[cr],
                    saved,
                    &params[l.expert(le)],
                    r,
                    expert_scale,
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
        aux_loss_bwd(&mut dprobs, &st.routed, st.tokens, k, T::of(aux_weight), n);
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
        let mut gw = vec![T::zero(); e * c];
        if n > 0 {
            matmul_bwd_weight(th, &mut gw, None, &dlogits, &cache.x, n, c, e);
        }
        if self.objective == Objective::Sum {
            // The router is replicated and each rank saw its own tokens: sum.
            comm.all_reduce_sum(&mut gw)?;
        }
        for (g, &v) in grads[l.router()].iter_mut().zip(&gw) {
            *g += v;
        }
        Ok(dx)
    }
}
