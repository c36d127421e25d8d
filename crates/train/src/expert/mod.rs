//! Expert parallelism: a mixture-of-experts feed-forward layer whose
//! experts are sharded over an EP group (000 §专家并行 L2493–2523, Fig 5.15;
//! F49 capacity, F50 all-to-all volume, F59 all-to-all cost).
//!
//! Legend: N = tokens on this rank, C = channels, F = expert hidden width,
//! E = experts, k = experts per token (1 or 2), ep = EP group size,
//! El = E / ep experts per rank, R = rows an expert rank computes.
//!
//! ```text
//!  x ─ router ─ softmax ─ top-k ─ capacity ─[a2a dispatch]─ experts ─[a2a combine]─ Σ gate·ye ─ y
//! dx ←──────── router bwd ←──── gate bwd ←──[a2a]────────── expert bwd ←─[a2a]───── dy
//! ```
//!
//! Rules (the single-process [`MoeLayer`] and the EP [`EpMoeLayer`] apply
//! the same ones, so EP = p on p slices of a batch equals EP = 1 on the
//! whole batch, within float summation order):
//!
//! - **Gate.** k = 1: the gate is the top probability (Switch). k = 2: the
//!   two top probabilities renormalised to sum to 1 (Mixtral; equal to a
//!   softmax over the two top logits). Ties go to the lowest expert index.
//! - **Capacity** per expert = ⌈capacity_factor · N_global · k / E⌉ (F49),
//!   applied per expert *globally*: an expert's assignments are taken in
//!   global token order (rank r's tokens come after ranks < r's), and
//!   those past the capacity are dropped. A dropped assignment contributes
//!   zero (the residual outside the layer carries the token); the other
//!   choice of a top-2 token keeps its gate (no renormalisation after a
//!   drop).
//! - **Aux loss** (Switch Transformer): `aux = E · Σ_e f_e · P_e` with
//!   `f_e` = assignments routed to e (all k choices, before capacity) /
//!   (N_global · k), so Σ f = 1 and a perfect balance gives aux = 1, and
//!   `P_e` = mean router probability of e. Only the `P_e` term carries a
//!   gradient (into the router); it enters the objective as
//!   `aux_weight · aux`.
//!
//! - [`gate`]: the router's kernels (softmax, top-k, gate, aux loss) and
//!   their backwards.
//! - [`dispatch`]: which assignments are kept, and where rows go in the
//!   all-to-alls.
//! - [`layer`]: the expert MLPs and [`MoeLayer`] / [`EpMoeLayer`].
//! - [`decoder`]: a decoder with an MoE feed-forward in every block ([`MoeModel`]),
//!   trained with expert parallelism ([`MoeTrainer`]).
use crate::error::{Result, TrainError};
use std::ops::Range;

pub mod decoder;
pub mod dispatch;
pub mod gate;
pub mod layer;

pub use decoder::{
    MoeModel, MoeModelConfig, MoeModelLayout, MoeStepStats, MoeTrainConfig, MoeTrainer,
};
pub use dispatch::{EpComm, LocalComm};
pub use layer::{EpMoeLayer, MoeLayer};

fn bad(
    field: &'static str,
    value: impl std::fmt::Display,
    reason: impl Into<String>,
) -> TrainError {
    TrainError::Config {
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

    /// Parameters of one expert: fc (F, C) + (F), fcp (C, F) + (C).
    pub fn expert_len(&self) -> usize {
        2 * self.hidden * self.channels + self.hidden + self.channels
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

/// Where each tensor lies in a rank's flat parameter buffer:
/// router `Wg` (E, C) first, then the rank's El experts one after another,
/// each `fc_w` (F, C), `fc_b` (F), `fcp_w` (C, F), `fcp_b` (C).
///
/// With ep = 1 this is the whole layer; rank r of ep holds experts
/// `r·El .. (r+1)·El`, and concatenating the ranks' expert parts (after one
/// router) gives the ep = 1 buffer ([`MoeLayout::gather`]).
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
    /// fc weight (F, C).
    pub fc_w: Range<usize>,
    /// fc bias (F).
    pub fc_b: Range<usize>,
    /// fcp weight (C, F).
    pub fcp_w: Range<usize>,
    /// fcp bias (C).
    pub fcp_b: Range<usize>,
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

    /// The whole slice of local expert `le` (0..El).
    pub fn expert(&self, le: usize) -> Range<usize> {
        let start = self.router().end + le * self.cfg.expert_len();
        start..start + self.cfg.expert_len()
    }

    /// Offsets of an expert's tensors relative to [`MoeLayout::expert`].
    pub fn expert_params(&self) -> ExpertParams {
        let (c, f) = (self.cfg.channels, self.cfg.hidden);
        ExpertParams {
            fc_w: 0..f * c,
            fc_b: f * c..f * c + f,
            fcp_w: f * c + f..2 * f * c + f,
            fcp_b: 2 * f * c + f..2 * f * c + f + c,
        }
    }

    /// Parameters of this rank.
    pub fn len(&self) -> usize {
        self.router().end + self.local_experts() * self.cfg.expert_len()
    }

    /// Whether the rank holds no parameters (never: the router is replicated).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// This rank's buffer cut from the ep = 1 buffer `full`.
    pub fn shard<T: Copy>(&self, full: &[T]) -> Result<Vec<T>> {
        let whole = MoeLayout::new(self.cfg, 1, 0)?;
        check_len("full moe parameters", whole.len(), full.len())?;
        let el = self.local_experts();
        let mut out = full[self.router()].to_vec();
        out.extend_from_slice(
            &full[whole.expert(self.rank * el).start..whole.expert((self.rank + 1) * el - 1).end],
        );
        Ok(out)
    }

    /// The ep = 1 buffer from every rank's buffer (rank order); the router
    /// is taken from rank 0 (replicas are equal after an all-reduce).
    pub fn gather<T: Copy>(cfg: MoeConfig, shards: &[Vec<T>]) -> Result<Vec<T>> {
        let ep = shards.len();
        cfg.check_ep(ep)?;
        let mut out = Vec::new();
        for (r, s) in shards.iter().enumerate() {
            let l = MoeLayout::new(cfg, ep, r)?;
            check_len("moe parameter shard", l.len(), s.len())?;
            if r == 0 {
                out.extend_from_slice(&s[l.router()]);
            }
            out.extend_from_slice(&s[l.router().end..]);
        }
        Ok(out)
    }
}

pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(model::ModelError::Shape {
            what,
            expected,
            got,
        }
        .into());
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
