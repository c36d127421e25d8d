//! The MoE decoder with expert parallelism under the one run loop: its settings
//! ([`MoeSettings`]), the mapping from the run's [`TrainConfig`] to the MoE trainer's config
//! ([`moe_train_config`]), the refusals of what the MoE engine does not build
//! ([`check_moe`]), and the engine ([`ExpertEngine`]).
//!
//! Expert parallelism runs over the data-parallel axis: the EP group is the whole world (each
//! rank a data-parallel replica of the dense tensors holding `E / ep` experts), so `ep` must
//! equal the number of ranks; expert parallelism inside replica groups, and MoE with tensor or
//! pipeline parallelism, are not built.
use std::time::Instant;

use comm::group::{GroupConfig, ProcessGroup};
use comm::local::LocalRendezvous;
use model::config::{Activation, ModelConfig, Norm, Positions};

use super::config::{RunConfig, refused};
use crate::config::TrainConfig;
use crate::error::Result;
use crate::expert::{MoeConfig, MoeModelConfig, MoeModelLayout, MoeTrainConfig, MoeTrainer};
use crate::trainer::{StateMemory, StepStats};

/// The MoE settings of a run (`flotilla train --experts E ...`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeSettings {
    /// E, experts in every block's feed-forward (each `ffn` wide).
    pub experts: usize,
    /// k, experts per token: 1 or 2.
    pub top_k: usize,
    /// Capacity factor (per-expert capacity ⌈factor · N · k / E⌉ over the group).
    pub capacity_factor: f64,
    /// Weight of the load-balancing loss in the objective.
    pub aux_weight: f64,
    /// Expert-parallel degree: the experts are split over this many ranks.
    pub ep: usize,
}

/// Why `m` is not a model the MoE decoder represents (None: it is one): GPT-2's family, i.e.
/// LayerNorm with biases, exact GELU experts, learned positions, multi-head attention, an
/// untied LM head (`expert::decoder`'s block).
fn unrepresentable(m: &ModelConfig) -> Option<String> {
    let why = [
        (
            m.norm != Norm::LayerNorm,
            "RMSNorm (its norms are LayerNorms)",
        ),
        (!m.bias, "linears without biases (its linears have biases)"),
        (
            m.activation != Activation::Gelu,
            "SwiGLU or tanh-GELU feed-forwards (its experts are exact-GELU MLPs)",
        ),
        (
            m.positions != Positions::Learned,
            "rotary positions (it learns a position table)",
        ),
        (
            m.kv_heads != m.heads,
            "grouped-query attention (its attention has as many KV heads as heads)",
        ),
        (
            m.tied_embeddings,
            "a tied LM head (its head is its own (V, C) matrix: add --untied)",
        ),
    ];
    why.into_iter().find(|(bad, _)| *bad).map(|(_, w)| w.into())
}

/// The MoE trainer's config for `train` with `s`: the model's width, heads, layers,
/// vocabulary and positions, each expert `ffn` wide; batch (rows per rank), sequence length,
/// peak learning rate, AdamW, clipping, seed, threads and data as given. Refuses a model the
/// MoE decoder does not represent (naming what) and bad MoE settings (naming the flag).
pub fn moe_train_config(train: &TrainConfig, s: &MoeSettings) -> Result<MoeTrainConfig> {
    let m = &train.model;
    if let Some(why) = unrepresentable(m) {
        return Err(refused(format!(
            "--experts {}: the MoE decoder is GPT-2's block with an MoE feed-forward and does \
             not build {why}",
            s.experts
        )));
    }
    let model = MoeModelConfig {
        vocab: m.vocab,
        seq_len: m.seq_len,
        layers: m.layers,
        heads: m.heads,
        moe: MoeConfig {
            experts: s.experts,
            top_k: s.top_k,
            channels: m.d_model,
            hidden: m.ffn,
            capacity_factor: s.capacity_factor,
            aux_weight: s.aux_weight,
        },
        norm_eps: m.norm_eps,
    };
    MoeModelLayout::new(model, s.ep.max(1), 0).map_err(|e| {
        refused(format!(
            "--experts {} --top-k {} --ep {}: {e}",
            s.experts, s.top_k, s.ep
        ))
    })?;
    Ok(MoeTrainConfig {
        model,
        batch: train.batch,
        seq_len: train.seq_len,
        lr: train.lr,
        adamw: train.adamw,
        grad_clip: train.grad_clip,
        seed: train.seed,
        threads: train.threads,
        data: train.data.clone(),
    })
}

/// Refuses, before any worker starts, what the MoE engine does not build for a job of
/// `world` ranks, with the reason.
pub fn check_moe(cfg: &RunConfig, s: &MoeSettings, world: usize) -> Result<()> {
    let (l, t) = (&cfg.layout, &cfg.train);
    let e = s.experts;
    let not_built = [
        (l.tp > 1, format!("--tp {}", l.tp)),
        (l.pp > 1, format!("--pp {}", l.pp)),
        (l.zero != 0, format!("--zero {}", l.zero)),
        (t.bf16, "--bf16".into()),
        (t.recompute, "--recompute".into()),
        (t.grad_accum > 1, format!("--grad-accum {}", t.grad_accum)),
    ];
    if let Some((_, what)) = not_built.into_iter().find(|(bad, _)| *bad) {
        return Err(refused(format!(
            "{what} with --experts {e}: the MoE engine (expert parallelism over the \
             data-parallel ranks) builds none of tensor or pipeline parallelism, ZeRO, bf16, \
             recomputation or gradient accumulation yet"
        )));
    }
    let mp = l.tp * l.pp;
    let dp = world / mp.max(1);
    if s.ep != dp {
        return Err(refused(format!(
            "--ep {} must equal the data-parallel degree {dp} (nproc x nnodes / (tp x pp) = \
             {world} / {mp}): expert parallelism inside replica groups is not built yet",
            s.ep
        )));
    }
    for (given, flag) in [(&cfg.save, "--save"), (&cfg.export_hf, "--export-hf")] {
        if given.is_some() {
            return Err(refused(format!(
                "{flag} with --experts {e}: the saved-model and Hugging Face formats hold dense \
                 decoders; an MoE export is not built"
            )));
        }
    }
    if cfg
        .checkpoint
        .as_ref()
        .is_some_and(|c| c.auto_mtbf.is_some())
    {
        return Err(refused(format!(
            "--ckpt-auto-mtbf with --experts {e}: the automatic interval is not built for the \
             MoE engine; use --ckpt-every"
        )));
    }
    moe_train_config(t, s).map(drop)
}

/// One rank's MoE engine: the trainer, the single-rank group's store of a one-process run,
/// and the routing figures of the run for its report.
pub struct ExpertEngine {
    trainer: MoeTrainer,
    /// Keeps a one-process run's own rendezvous store alive.
    _local: Option<LocalRendezvous>,
    /// The last step's aux loss (Σ over layers, unweighted), and the run's dropped and routed
    /// assignments.
    aux: f64,
    dropped: usize,
    routed: usize,
}

impl ExpertEngine {
    /// The engine of `cfg` with `s` on this rank of `group` (None: one process, which gets a
    /// group of its own).
    pub fn build(cfg: &RunConfig, s: &MoeSettings, group: Option<ProcessGroup>) -> Result<Self> {
        let tc = moe_train_config(&cfg.train, s)?;
        let (group, local) = match group {
            Some(g) => (g, None),
            None => {
                let local = LocalRendezvous::start()?;
                let g = ProcessGroup::new(&local.rdv, "moe", 0, 1, GroupConfig::default())?;
                (g, Some(local))
            }
        };
        let trainer = MoeTrainer::new(tc, group)
            .and_then(|t| t.with_schedule(cfg.train.schedule))?
            .with_decay_all(cfg.train.decay_all);
        Ok(Self {
            trainer,
            _local: local,
            aux: 0.0,
            dropped: 0,
            routed: 0,
        })
    }

    /// The trainer.
    pub fn trainer(&mut self) -> &mut MoeTrainer {
        &mut self.trainer
    }

    /// One step, as the run loop reports steps: the tokens are the group's (`batch · T · ep`),
    /// the loss the cross-entropy (the aux loss is reported at the end), the communication
    /// the dense gradients' all-reduce (the all-to-alls inside the layers are not separated
    /// from their compute).
    pub fn step(&mut self) -> Result<StepStats> {
        let t0 = Instant::now();
        let s = self.trainer.step()?;
        let seconds = t0.elapsed().as_secs_f64();
        self.aux = s.aux;
        self.dropped += s.dropped_assignments();
        self.routed += s
            .layers
            .iter()
            .map(|l| l.routed.iter().sum::<usize>())
            .sum::<usize>();
        let c = self.trainer.config();
        Ok(StepStats {
            step: self.trainer.steps_done(),
            loss: s.loss,
            lr: s.lr,
            grad_norm: s.norm,
            tokens: c.batch * c.seq_len * self.trainer.group().size(),
            seconds,
            data_seconds: 0.0,
            comm_seconds: s.allreduce_seconds,
        })
    }

    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.trainer.steps_done()
    }

    /// The planner's forecast of one step ([`MoeTrainer::forecast`]; a collective).
    pub fn forecast(&self) -> Result<crate::forecast::Forecast> {
        self.trainer.forecast()
    }

    /// The resident bytes of this rank's parameters, gradients and AdamW moments.
    pub fn state_memory(&self) -> StateMemory {
        self.trainer.state_memory()
    }

    /// Model FLOPs per trained token, counting the parameters a token is active in (forward
    /// and backward, the dense estimate's convention):
    ///
    /// `6 · (N_dense − T·C + L · (E·C + k · P_e)) + 12 · L · T · C`
    ///
    /// with N_dense the dense part (embeddings, attention, norms, head), T·C the position table
    /// (a lookup), E·C each layer's router (every token scores every expert), k the experts a
    /// token is sent to and `P_e = 2·F·C + F + C` one expert's parameters; the last term is
    /// attention over `T` (the `seq_len` trained).
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        let l = self.trainer.layout();
        let m = &l.cfg;
        let c = m.moe.channels;
        let per_layer = m.moe.experts * c + m.moe.top_k * m.moe.expert_len();
        let active = l.dense - m.seq_len * c + m.layers * per_layer;
        6.0 * active as f64 + 12.0 * (m.layers * seq_len * c) as f64
    }

    /// The whole (ep = 1) parameters, gathered from every rank's shard (a collective).
    pub fn whole_params(&self) -> Result<Vec<f32>> {
        let g = self.trainer.group();
        let mine = self.trainer.params();
        let mut all = vec![0f32; mine.len() * g.size()];
        g.all_gather(mine, &mut all)?;
        let shards: Vec<Vec<f32>> = all.chunks(mine.len()).map(<[f32]>::to_vec).collect();
        MoeModelLayout::gather(self.trainer.layout().cfg, &shards)
    }

    /// Parameters of the whole (ep = 1) model.
    pub fn whole_len(&self) -> usize {
        MoeModelLayout::new(self.trainer.layout().cfg, 1, 0).map_or(0, |w| w.total)
    }

    /// The run's MoE line: experts, k, EP degree, the whole model's and a token's active
    /// parameters, the last step's aux loss, and the assignments dropped by capacity.
    pub fn summary(&self) -> String {
        let l = self.trainer.layout();
        let m = &l.cfg.moe;
        let whole = self.whole_len();
        format!(
            "# moe: {} experts, top-{}, capacity factor {}, ep {}: {:.2}M parameters ({:.2}M per rank); \
             last aux loss {:.4} (x{} in the objective); {} of {} assignments dropped by capacity ({:.2} %)",
            m.experts,
            m.top_k,
            m.capacity_factor,
            self.trainer.group().size(),
            whole as f64 / 1e6,
            l.total as f64 / 1e6,
            self.aux,
            m.aux_weight,
            self.dropped,
            self.routed,
            100.0 * self.dropped as f64 / (self.routed.max(1)) as f64
        )
    }
}
