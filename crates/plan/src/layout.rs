//! A parallel layout (TP × PP × DP, EP inside DP, micro-batch, schedule, ZeRO, recomputation) and
//! its validation against a model and a cluster (000 F8: N_total = d × p × t).

use crate::error::{PlanError, Result};
use crate::pipeline::Schedule;
use serde::{Deserialize, Serialize};

/// ZeRO / FSDP sharding stage (000 §ZeRO, Table 5.3). Written as 0–3 in TOML.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub enum ZeroStage {
    /// Plain data parallelism: every replica holds everything.
    #[default]
    None,
    /// Stage 1: optimizer state sharded.
    Optimizer,
    /// Stage 2: optimizer state and gradients sharded.
    Gradients,
    /// Stage 3 (FSDP): parameters too.
    Parameters,
}

impl TryFrom<u8> for ZeroStage {
    type Error = String;
    fn try_from(v: u8) -> std::result::Result<Self, String> {
        match v {
            0 => Ok(ZeroStage::None),
            1 => Ok(ZeroStage::Optimizer),
            2 => Ok(ZeroStage::Gradients),
            3 => Ok(ZeroStage::Parameters),
            _ => Err(format!("zero stage {v} is not one of 0, 1, 2, 3")),
        }
    }
}

impl From<ZeroStage> for u8 {
    fn from(z: ZeroStage) -> u8 {
        z as u8
    }
}

/// Activation recomputation (Korthikanti et al. 2022).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    /// Keep every activation.
    #[default]
    None,
    /// Recompute the attention core only (drops the 5as/h term).
    Selective,
    /// Keep each layer's input only; recompute the whole forward.
    Full,
}

/// One parallel configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// Tensor-parallel degree t.
    pub tp: u64,
    /// Pipeline stages p.
    pub pp: u64,
    /// Data-parallel replicas d.
    pub dp: u64,
    /// Expert-parallel degree (inside DP; 1 for dense models).
    #[serde(default = "one")]
    pub ep: u64,
    /// Sequences per micro-batch b.
    #[serde(default = "one")]
    pub micro_batch: u64,
    /// Virtual stages per device v (interleaved schedule only).
    #[serde(default = "one")]
    pub interleave: u64,
    /// Pipeline schedule.
    #[serde(default)]
    pub schedule: Schedule,
    /// ZeRO stage over the DP group.
    #[serde(default)]
    pub zero: ZeroStage,
    /// Activation recomputation.
    #[serde(default)]
    pub recompute: Recompute,
    /// Megatron sequence parallelism (shards LayerNorm/dropout activations over TP).
    #[serde(default = "yes")]
    pub sequence_parallel: bool,
    /// Megatron's vocabulary-parallel embedding and head (each TP rank holds V/t rows of the
    /// embedding matrices). `false`: the embeddings and head are replicated whole on every TP
    /// rank, as Flotilla's tensor-parallel engine does today (`train::tensor`).
    #[serde(default = "yes")]
    pub vocab_parallel: bool,
    /// Context-parallel degree (the sequence split over `cp` devices, K/V exchanged in a ring;
    /// Megatron-Core's context parallelism). 1 = off.
    #[serde(default = "one")]
    pub cp: u64,
    /// Accept layer counts that pp × interleave does not divide: the slowest stage holds
    /// ⌈L/(p·v)⌉ layers per virtual stage (default false: refused, as before).
    #[serde(default)]
    pub uneven_stages: bool,
    /// Tensor-parallel communication overlapped with the neighbouring GEMMs (Megatron-Core /
    /// Transformer Engine `tp_comm_overlap`); only the part longer than those GEMMs is exposed.
    #[serde(default)]
    pub tp_overlap: bool,
    /// The embedding and the LM head each take one layer's slot in the pipeline split
    /// (Megatron-Core's account_for_embedding/loss_in_pipeline_split, DeepSpeed's
    /// `type:transformer|embedding` partition): stages hold (L + 2)/(p·v) slots per virtual
    /// stage, the first and last one layer fewer. Default false: the last stage holds L/p layers
    /// and the head.
    #[serde(default)]
    pub embedding_slots: bool,
}

fn one() -> u64 {
    1
}
fn yes() -> bool {
    true
}

impl Layout {
    /// A plain layout with defaults for everything but the three degrees.
    pub fn new(tp: u64, pp: u64, dp: u64) -> Layout {
        Layout {
            tp,
            pp,
            dp,
            ep: 1,
            micro_batch: 1,
            interleave: 1,
            schedule: Schedule::OneFOneB,
            zero: ZeroStage::None,
            recompute: Recompute::None,
            sequence_parallel: true,
            vocab_parallel: true,
            cp: 1,
            uneven_stages: false,
            tp_overlap: false,
            embedding_slots: false,
        }
    }

    /// Devices used: t × p × d × cp.
    pub fn devices(&self) -> u64 {
        self.tp
            .saturating_mul(self.pp)
            .saturating_mul(self.dp)
            .saturating_mul(self.cp)
    }

    /// Transformer blocks on the most loaded pipeline stage: L/p, or ⌈L/(p·v)⌉·v with uneven
    /// stages.
    pub fn layers_per_stage(&self, layers: u64) -> u64 {
        let pv = self.pp.saturating_mul(self.interleave).max(1);
        let slots = self.pipeline_slots(layers);
        if self.uneven_stages {
            slots.div_ceil(pv) * self.interleave.max(1)
        } else {
            slots / self.pp.max(1)
        }
    }

    /// Transformer blocks on the first pipeline stage, the one that holds the embedding and the
    /// most micro-batches in flight: [`Layout::layers_per_stage`], one fewer with
    /// [`Layout::embedding_slots`] (the embedding takes one of its slots: BigScience tr11-176B
    /// README, "pp rank 0: [embed | 5 transformer blocks]" for 72 slots on 12 stages).
    pub fn first_stage_layers(&self, layers: u64) -> u64 {
        let per = self.layers_per_stage(layers);
        if self.embedding_slots && self.pp > 1 {
            per.saturating_sub(1)
        } else {
            per
        }
    }

    /// Slots the pipeline split shares out: L, or L + 2 with [`Layout::embedding_slots`].
    pub fn pipeline_slots(&self, layers: u64) -> u64 {
        if self.embedding_slots && self.pp > 1 {
            layers + 2
        } else {
            layers
        }
    }

    /// Compute of the slowest stage for one micro-batch, from one layer's time and the head's:
    /// L_stage·t_layer + t_head, or with embedding slots max(S·t_layer, (S − 1)·t_layer + t_head)
    /// with S slots per stage (the first stage's embedding lookup is negligible).
    pub fn slowest_stage(&self, layers: u64, t_layer: f64, t_head: f64) -> f64 {
        let per = self.layers_per_stage(layers) as f64;
        if self.embedding_slots && self.pp > 1 {
            (per * t_layer).max((per - 1.0) * t_layer + t_head)
        } else {
            per * t_layer + t_head
        }
    }

    /// Micro-batches per step per pipeline: m = B / (d·b).
    pub fn microbatches(&self, global_batch: u64) -> u64 {
        global_batch / self.dp.saturating_mul(self.micro_batch).max(1)
    }

    /// Checks the layout against the model shape, the global batch and the device count. Each
    /// refusal states the equation: "tp x pp x dp = 2 x 4 x 64 = 512 != 1024 devices".
    pub fn validate(
        &self,
        layers: u64,
        heads: u64,
        kv_heads: u64,
        experts: u64,
        global_batch: u64,
        devices: u64,
    ) -> Result<()> {
        let bad =
            |field: &'static str, equation: String| PlanError::Inconsistent { field, equation };
        for (f, v) in [
            ("layout.tp", self.tp),
            ("layout.pp", self.pp),
            ("layout.dp", self.dp),
            ("layout.ep", self.ep),
            ("layout.micro_batch", self.micro_batch),
            ("layout.interleave", self.interleave),
            ("layout.cp", self.cp),
        ] {
            if v == 0 {
                return Err(PlanError::Invalid {
                    field: f,
                    value: "0".into(),
                    reason: "must be >= 1".into(),
                });
            }
        }
        if self.devices() != devices {
            let cp = if self.cp > 1 {
                format!(" x cp {}", self.cp)
            } else {
                String::new()
            };
            return Err(bad(
                "layout",
                format!(
                    "tp x pp x dp = {} x {} x {}{cp} = {} != {} devices",
                    self.tp,
                    self.pp,
                    self.dp,
                    self.devices(),
                    devices
                ),
            ));
        }
        if !heads.is_multiple_of(self.tp) {
            return Err(bad(
                "layout.tp",
                format!("tp {} does not divide heads {heads}", self.tp),
            ));
        }
        if !kv_heads.is_multiple_of(self.tp) && !self.tp.is_multiple_of(kv_heads) {
            return Err(bad(
                "layout.tp",
                format!(
                    "tp {} and kv_heads {kv_heads}: neither divides the other",
                    self.tp
                ),
            ));
        }
        if self.pp > layers {
            return Err(bad(
                "layout.pp",
                format!("pp {} > layers {layers}", self.pp),
            ));
        }
        if self.uneven_stages && self.pp.saturating_mul(self.interleave) > layers {
            return Err(bad(
                "layout.pp",
                format!(
                    "pp x interleave = {} x {} > layers {layers}",
                    self.pp, self.interleave
                ),
            ));
        }
        if !self.uneven_stages
            && !self
                .pipeline_slots(layers)
                .is_multiple_of(self.pp.saturating_mul(self.interleave))
        {
            return Err(bad(
                "layout.pp",
                format!(
                    "pp x interleave = {} x {} = {} does not divide layers {layers}",
                    self.pp,
                    self.interleave,
                    self.pp.saturating_mul(self.interleave)
                ),
            ));
        }
        if self.interleave > 1 && self.schedule != Schedule::Interleaved {
            return Err(bad(
                "layout.interleave",
                format!(
                    "interleave {} needs schedule = \"interleaved\"",
                    self.interleave
                ),
            ));
        }
        if self.ep > 1 && (!experts.is_multiple_of(self.ep) || !self.dp.is_multiple_of(self.ep)) {
            return Err(bad(
                "layout.ep",
                format!(
                    "ep {} must divide experts {experts} and dp {}",
                    self.ep, self.dp
                ),
            ));
        }
        let per_step = self.dp.saturating_mul(self.micro_batch);
        if !global_batch.is_multiple_of(per_step) {
            return Err(bad(
                "job.global_batch",
                format!(
                    "dp x micro_batch = {} x {} = {per_step} does not divide global_batch {global_batch}",
                    self.dp, self.micro_batch
                ),
            ));
        }
        Ok(())
    }
}
