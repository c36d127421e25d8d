//! Mixture-of-experts feed-forward: the router, capacity, the expert MLPs and the expert
//! dispatch / combine exchange (000 §专家并行 L2493–2523, Fig 5.15; F49 capacity, F50
//! all-to-all volume, F59 all-to-all cost), over flat parameter buffers ([`MoeLayout`]). A
//! block whose config has [`crate::config::MoeSpec`] runs [`layer::Experts`] as its
//! feed-forward half; the exchange goes through [`ExpertComm`] (one rank: [`Local`]).
//!
//! Legend: N = tokens on this rank, C = channels, F = expert hidden width (Fin = F, or 2F for
//! SwiGLU), E = experts, k = experts per token (1 or 2), ep = EP group size, El = E / ep experts
//! per rank, R = rows an expert rank computes.
//!
//! ```text
//!  x ─ router ─ softmax ─ top-k ─ capacity ─[a2a dispatch]─ experts ─[a2a combine]─ Σ gate·ye ─ y
//! dx ←──────── router bwd ←──── gate bwd ←──[a2a]────────── expert bwd ←─[a2a]───── dy
//! ```
//!
//! Rules (every EP degree applies the same ones, so EP = p on p slices of a batch equals
//! EP = 1 on the whole batch, within float summation order):
//!
//! - **Gate.** k = 1: the gate is the top probability (Switch). k = 2: the two top
//!   probabilities renormalised to sum to 1 (Mixtral; equal to a softmax over the two top
//!   logits). Ties go to the lowest expert index.
//! - **Capacity** per expert = ⌈capacity_factor · N_global · k / E⌉ (F49), applied per expert
//!   *globally*: an expert's assignments are taken in global token order (rank r's tokens come
//!   after ranks < r's), and those past the capacity are dropped. A dropped assignment
//!   contributes zero (the residual outside the layer carries the token); the other choice of
//!   a top-2 token keeps its gate (no renormalisation after a drop).
//! - **Aux loss** (Switch Transformer): `aux = E · Σ_e f_e · P_e` with `f_e` = assignments
//!   routed to e (all k choices, before capacity) / (N_global · k), so Σ f = 1 and a perfect
//!   balance gives aux = 1, and `P_e` = mean router probability of e. Only the `P_e` term
//!   carries a gradient (into the router); it enters the objective as `aux_weight · aux`.
//!
//! - [`gate`]: the router's kernels (softmax, top-k, gate, aux loss) and their backwards.
//! - [`dispatch`]: which assignments are kept, and where rows go in the all-to-alls.
//! - [`layer`]: the expert MLPs and the layer's forward and backward.
use crate::config::Activation;
use crate::error::{ModelError, Result};
use std::ops::Range;

pub mod dispatch;
pub mod gate;
pub mod layer;

pub use dispatch::{ExpertComm, Local};
pub use layer::{Experts, Objective};

fn bad(
    field: &'static str,
    value: impl std::fmt::Display,
    reason: impl Into<String>,
) -> ModelError {
    ModelError::Config {
        field,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Shape and routing settings of one MoE layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    /// E, the number of experts, >= 1.
    pub experts: usize,
    /// k, experts per token: 1 (Switch) or 2 (Mixtral, GShard); <= E.
    pub top_k: usize,
    /// C, the model width (input and output of every expert), >= 1.
    pub channels: usize,
    /// F, each expert's hidden width, >= 1.
    pub hidden: usize,
    /// Capacity factor (000 L2521: 1.25–1.5), finite and > 0; see
    /// [`MoeConfig::capacity`].
    pub capacity_factor: f64,
    /// Weight of the auxiliary load-balancing loss in the objective
    /// (000 L2521: 0.01–0.1), finite and >= 0; 0 disables its gradient.
    pub aux_weight: f64,
    /// Each expert's nonlinearity (the block's: GELU, tanh-GELU or SwiGLU, whose first linear
    /// is then 2F wide, gate and up fused).
    pub activation: Activation,
    /// Whether the experts' linears carry biases.
    pub bias: bool,
}

impl MoeConfig {
    /// Check every field, naming the first bad one.
    pub fn validate(&self) -> Result<()> {
        if self.experts == 0 {
            return Err(bad("experts", self.experts, "must be >= 1"));
        }
        if !(self.top_k == 1 || self.top_k == 2) {
            return Err(bad("top_k", self.top_k, "must be 1 or 2"));
        }
        if self.top_k > self.experts {
            return Err(bad(
                "top_k",
                self.top_k,
                format!("must be <= experts ({})", self.experts),
            ));
        }
        if self.channels == 0 {
            return Err(bad("channels", self.channels, "must be >= 1"));
        }
        if self.hidden == 0 {
            return Err(bad("hidden", self.hidden, "must be >= 1"));
        }
        if !(self.capacity_factor.is_finite() && self.capacity_factor > 0.0) {
            return Err(bad(
                "capacity_factor",
                self.capacity_factor,
                "must be finite and > 0",
            ));
        }
        if !(self.aux_weight.is_finite() && self.aux_weight >= 0.0) {
            return Err(bad(
                "aux_weight",
                self.aux_weight,
                "must be finite and >= 0",
            ));
        }
        Ok(())
    }

    /// Per-expert capacity for `tokens` tokens in the routing group:
    /// ⌈capacity_factor · tokens · k / E⌉ (F49).
    pub fn capacity(&self, tokens: usize) -> usize {
        (self.capacity_factor * (tokens * self.top_k) as f64 / self.experts as f64).ceil() as usize
    }

    /// Output width of an expert's first linear: F, or 2F for SwiGLU.
    pub fn hidden_in(&self) -> usize {
        match self.activation {
            Activation::SwiGlu => 2 * self.hidden,
            _ => self.hidden,
        }
    }

    /// Parameters of one expert: fc (Fin, C) + (Fin), fcp (C, F) + (C), the biases only with
    /// `bias`.
    pub fn expert_len(&self) -> usize {
        let (c, f, fin) = (self.channels, self.hidden, self.hidden_in());
        fin * c + c * f + if self.bias { fin + c } else { 0 }
    }

    /// Check that `ep` ranks can share the experts evenly.
    pub fn check_ep(&self, ep: usize) -> Result<()> {
        if ep == 0 || !self.experts.is_multiple_of(ep) {
            return Err(bad(
                "experts",
                self.experts,
                format!(
                    "experts % ep == 0 is required, but experts ({}) % ep ({ep}) = {}",
                    self.experts,
                    self.experts.checked_rem(ep).unwrap_or(self.experts)
                ),
            ));
        }
        Ok(())
    }
}

/// Where each tensor lies in the layer's flat parameter buffer: router `Wg` (E, C) first,
/// then all E experts one after another, each `fc_w` (Fin, C), `fc_b` (Fin), `fcp_w` (C, F),
/// `fcp_b` (C) (biases only with `bias`). The buffer is the whole layer's on every rank of an
/// EP group (the model's addresses); rank r of ep reads and writes only the router and its
/// experts `r·El .. (r+1)·El` ([`MoeLayout::expert_range`]); the others' stay untouched.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeLayout {
    /// The layer's settings.
    pub cfg: MoeConfig,
    /// EP group size.
    pub ep: usize,
    /// This rank in the EP group.
    pub rank: usize,
}

/// Offsets of one expert's tensors inside its slice of the buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertParams {
    /// fc weight (Fin, C).
    pub fc_w: Range<usize>,
    /// fc bias (Fin).
    pub fc_b: Option<Range<usize>>,
    /// fcp weight (C, F).
    pub fcp_w: Range<usize>,
    /// fcp bias (C).
    pub fcp_b: Option<Range<usize>>,
}

impl MoeLayout {
    /// The layout of `rank` in an `ep`-way group (refuses ep not dividing E
    /// or a rank outside the group).
    pub fn new(cfg: MoeConfig, ep: usize, rank: usize) -> Result<Self> {
        cfg.validate()?;
        cfg.check_ep(ep)?;
        if rank >= ep {
            return Err(bad("rank", rank, format!("must be < ep ({ep})")));
        }
        Ok(Self { cfg, ep, rank })
    }

    /// El, experts on this rank.
    pub fn local_experts(&self) -> usize {
        self.cfg.experts / self.ep
    }

    /// Global indices of this rank's experts.
    pub fn expert_range(&self) -> Range<usize> {
        let el = self.local_experts();
        self.rank * el..(self.rank + 1) * el
    }

    /// The router weight Wg (E, C).
    pub fn router(&self) -> Range<usize> {
        0..self.cfg.experts * self.cfg.channels
    }

    /// The slice of local expert `le` (0..El), global expert `rank·El + le`.
    pub fn expert(&self, le: usize) -> Range<usize> {
        let start =
            self.router().end + (self.rank * self.local_experts() + le) * self.cfg.expert_len();
        start..start + self.cfg.expert_len()
    }

    /// Offsets of an expert's tensors relative to [`MoeLayout::expert`].
    pub fn expert_params(&self) -> ExpertParams {
        let (c, f, fin) = (self.cfg.channels, self.cfg.hidden, self.cfg.hidden_in());
        let mut at = 0;
        let mut take = |len: usize| {
            at += len;
            at - len..at
        };
        let fc_w = take(fin * c);
        let fc_b = self.cfg.bias.then(|| take(fin));
        let fcp_w = take(c * f);
        let fcp_b = self.cfg.bias.then(|| take(c));
        ExpertParams {
            fc_w,
            fc_b,
            fcp_w,
            fcp_b,
        }
    }

    /// Elements of the layer's buffer: the router and all E experts.
    pub fn len(&self) -> usize {
        self.router().end + self.cfg.experts * self.cfg.expert_len()
    }

    /// Whether the buffer is empty (never: the router has E·C elements).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(ModelError::Shape {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// Routing metrics of one forward, over the whole EP group (000 Q10:
/// "report the token-drop rate and max/mean expert load").
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MoeStats {
    /// N_global, tokens routed by the group.
    pub tokens: usize,
    /// Per-expert capacity used.
    pub capacity: usize,
    /// (E) assignments routed to each expert, before capacity (the load).
    pub routed: Vec<usize>,
    /// (E) assignments each expert computed (after capacity).
    pub kept: Vec<usize>,
    /// Assignments dropped by capacity (Σ routed − Σ kept).
    pub dropped_assignments: usize,
    /// Tokens all of whose k assignments were dropped (they pass through the
    /// layer as zero; only the residual carries them).
    pub dropped_tokens: usize,
    /// The auxiliary load-balancing loss, unweighted.
    pub aux_loss: f64,
    /// Payload bytes this rank sent through the dispatch and combine
    /// all-to-alls (its own rows included).
    pub a2a_bytes: usize,
    /// The part of `a2a_bytes` that left the rank (F59's (ep−1)/ep share
    /// under uniform routing).
    pub a2a_bytes_off_rank: usize,
}

impl MoeStats {
    /// Largest expert load (assignments routed, before capacity).
    pub fn max_load(&self) -> usize {
        self.routed.iter().copied().max().unwrap_or(0)
    }

    /// Mean expert load (N_global · k / E).
    pub fn mean_load(&self) -> f64 {
        if self.routed.is_empty() {
            return 0.0;
        }
        self.routed.iter().sum::<usize>() as f64 / self.routed.len() as f64
    }

    /// Skew: max / mean load (1 = perfectly balanced; 000 L2517 reports 3–5×
    /// without an aux loss). 0 when nothing was routed.
    pub fn load_skew(&self) -> f64 {
        let mean = self.mean_load();
        if mean == 0.0 {
            0.0
        } else {
            self.max_load() as f64 / mean
        }
    }
}
