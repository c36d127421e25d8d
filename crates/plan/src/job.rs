//! The job input: a model (preset or custom), batch, precision, optimizer, tokens to train, and
//! optional layout, checkpoint and data-pipeline sections. [`JobFile`] is the TOML form.

use crate::error::{PlanError, Result, at_least_one, at_most, fraction, non_negative, positive};
use crate::hardware::Precision;
use crate::layout::{Layout, ZeroStage};
use crate::model::{ModelShape, model_preset};
use serde::{Deserialize, Serialize};

/// The optimizer, which fixes K, the optimizer-state bytes per parameter (000 F17).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Optimizer {
    /// Adam/AdamW: FP32 m and v (8 B) plus an FP32 master copy under mixed precision (K = 12).
    #[default]
    Adam,
    /// SGD with momentum: momentum (4 B) plus the master copy (K = 8 mixed, 4 in FP32).
    SgdMomentum,
    /// Plain SGD: only the master copy (K = 4 mixed, 0 in FP32).
    Sgd,
}

impl Optimizer {
    /// K bytes per parameter for this optimizer under `p` (000 F17: 4 master + 4 m + 4 v = 12).
    pub fn state_bytes(self, p: Precision) -> f64 {
        let master = if p.mixed() { 4.0 } else { 0.0 };
        master
            + match self {
                Optimizer::Adam => 8.0,
                Optimizer::SgdMomentum => 4.0,
                Optimizer::Sgd => 0.0,
            }
    }
}

/// The `[model]` table: a preset, a custom shape, or a preset with fields overridden.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    /// A preset name (see [`crate::model::MODEL_PRESETS`]).
    pub preset: Option<String>,
    /// Transformer blocks.
    pub layers: Option<u64>,
    /// Width.
    pub hidden: Option<u64>,
    /// Attention heads.
    pub heads: Option<u64>,
    /// KV heads (default = heads).
    pub kv_heads: Option<u64>,
    /// MLP width (default 4·hidden).
    pub ffn: Option<u64>,
    /// Vocabulary.
    pub vocab: Option<u64>,
    /// Sequence length.
    pub seq: Option<u64>,
    /// MoE experts.
    pub experts: Option<u64>,
    /// MoE top-k.
    pub top_k: Option<u64>,
    /// Gated (SwiGLU) MLP.
    pub gated: Option<bool>,
    /// Tied input/output embeddings.
    pub tied_embeddings: Option<bool>,
    /// Head width when it is not hidden/heads.
    pub head_dim: Option<u64>,
    /// A layer norm on the embedding output (BLOOM); default false.
    pub embedding_norm: Option<bool>,
}

impl ModelFile {
    /// Resolves to a validated shape; a custom model must give layers, hidden, heads, vocab, seq.
    pub fn resolve(&self) -> Result<ModelShape> {
        let mut m = match &self.preset {
            Some(p) => model_preset(p)?,
            None => {
                let need = |field: &'static str, v: Option<u64>| {
                    v.ok_or(PlanError::Invalid {
                        field,
                        value: "missing".into(),
                        reason: "a custom model (no preset) needs it".into(),
                    })
                };
                let hidden = need("model.hidden", self.hidden)?;
                let heads = need("model.heads", self.heads)?;
                ModelShape {
                    name: "custom".into(),
                    layers: need("model.layers", self.layers)?,
                    hidden,
                    heads,
                    kv_heads: heads,
                    ffn: 4 * hidden,
                    vocab: need("model.vocab", self.vocab)?,
                    seq: need("model.seq", self.seq)?,
                    experts: 1,
                    top_k: 1,
                    gated: false,
                    tied_embeddings: true,
                    head_dim: None,
                    embedding_norm: false,
                }
            }
        };
        macro_rules! over {
            ($($f:ident),*) => { $( if let Some(v) = self.$f { m.$f = v; } )* };
        }
        over!(
            layers,
            hidden,
            heads,
            kv_heads,
            ffn,
            vocab,
            seq,
            experts,
            top_k,
            gated,
            tied_embeddings,
            embedding_norm
        );
        if self.head_dim.is_some() {
            m.head_dim = self.head_dim;
        }
        m.validate()?;
        Ok(m)
    }
}

/// The `[training]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingFile {
    /// Global batch in sequences.
    pub global_batch: u64,
    /// Matmul precision.
    #[serde(default)]
    pub precision: Precision,
    /// Optimizer.
    #[serde(default)]
    pub optimizer: Optimizer,
    /// Override of K (optimizer bytes per parameter).
    pub optimizer_bytes_per_param: Option<f64>,
    /// Tokens to train on.
    #[serde(default)]
    pub tokens: f64,
    /// Achieved fraction of peak FLOP/s on the matmuls (the roofline efficiency factor).
    #[serde(default = "d_eff")]
    pub efficiency: f64,
    /// Fraction of data-parallel communication hidden under compute (000 E18: 75%).
    #[serde(default = "d_overlap")]
    pub dp_overlap: f64,
    /// Critical batch B* in sequences, if known (000 F36).
    pub critical_batch: Option<f64>,
    /// Deadline in days (004 example 27.3).
    pub deadline_days: Option<f64>,
    /// How compute is priced: "roofline" (the default: one efficiency factor for all FLOPs) or
    /// "kernels" (each GEMM from its shape, attention as its kernel, memory-bound work from its
    /// bytes; [`crate::kernels`]).
    #[serde(default)]
    pub compute_model: ComputeModel,
    /// The attention kernel the run uses ("flash", the default, or "unfused"); `kernels` only.
    #[serde(default)]
    pub attention: AttentionKernel,
    /// Causal (decoder) attention: half the score FLOPs in a flash kernel (default true).
    #[serde(default = "d_true")]
    pub causal: bool,
    /// Gradient precision: "param" (the default: gradients stored like the weights), "fp32"
    /// (FP32 main gradients, Megatron's default: 2 + 4 + 12 = 18 bytes per parameter with Adam)
    /// or "param_and_fp32" (both, as DeepSpeed's BF16 optimizer keeps: 2 + 6 + 12 = 20).
    #[serde(default)]
    pub grad_precision: GradPrecision,
    /// Precision the data-parallel reduction moves: "grad" (the default: the kept gradient, the
    /// FP32 copy with "fp32" or "param_and_fp32") or "param" (cast to the weights' precision
    /// for the reduction, as DeepSpeed 0.6-0.7 does with BF16: `communication_data_type` is
    /// BF16 and `allreduce_bucket` casts the FP32 buffer to it).
    #[serde(default)]
    pub grad_comm_precision: GradCommPrecision,
    /// The pipeline engine: "megatron" (the default: nothing kept beyond the layers' own
    /// activations) or "deepspeed" (DeepSpeed's `PipelineEngine` keeps each in-flight
    /// micro-batch's TP-partitioned stage output and rebuilds the full output and gradient for
    /// the backward: [`crate::memory::device_memory`]). Memory only; kernel model only.
    #[serde(default)]
    pub pipeline_engine: PipelineEngine,
}

/// Which pipeline engine runs the stages (what it keeps in memory beside the layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PipelineEngine {
    /// Megatron-LM's schedules (output tensors deallocated after the send; today's meaning).
    #[default]
    Megatron,
    /// DeepSpeed's `PipelineEngine` (`deepspeed/runtime/pipe/engine.py`).
    Deepspeed,
}

impl PipelineEngine {
    /// Whether this engine can run `l`. DeepSpeed's `PipelineEngine` with more than one stage
    /// has no interleaved schedule (its `TrainSchedule` is 1F1B over one model chunk per
    /// stage) and refuses ZeRO stages 2 and 3 ("ZeRO-2 and ZeRO-3 are incompatible with
    /// pipeline parallelism", `deepspeed/runtime/pipe/engine.py`). Megatron's schedules run
    /// every layout.
    pub fn check(&self, l: &Layout) -> Result<()> {
        if *self != PipelineEngine::Deepspeed || l.pp <= 1 {
            return Ok(());
        }
        if l.interleave > 1 {
            return Err(PlanError::Inconsistent {
                field: "layout.interleave",
                equation: format!(
                    "interleave {} with pipeline_engine = \"deepspeed\": DeepSpeed's pipeline engine has no interleaved schedule",
                    l.interleave
                ),
            });
        }
        let stage = match l.zero {
            ZeroStage::Gradients => 2,
            ZeroStage::Parameters => 3,
            ZeroStage::None | ZeroStage::Optimizer => return Ok(()),
        };
        Err(PlanError::Inconsistent {
            field: "layout.zero",
            equation: format!(
                "zero {stage} with pipeline_engine = \"deepspeed\" and pp {} > 1: DeepSpeed refuses ZeRO-2 and ZeRO-3 with pipeline parallelism",
                l.pp
            ),
        })
    }
}

/// What the data-parallel gradient reduction moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GradCommPrecision {
    /// The kept gradient's bytes: the weights' bytes, or 4 when an FP32 gradient is kept
    /// ([`Job::grad_comm_bytes`]; today's meaning).
    #[default]
    Grad,
    /// The weights' bytes: the FP32 gradient is cast for the reduction and cast back.
    Param,
}

/// How the step's compute is priced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ComputeModel {
    /// max(F/(R·eff), Q/B_mem) with the job's single efficiency factor (004 eq. 28.2).
    #[default]
    Roofline,
    /// Shape-aware kernels: [`crate::kernels`].
    Kernels,
}

/// The attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKernel {
    /// Fused (FlashAttention, Dao et al. 2022): no score matrix in HBM.
    #[default]
    Flash,
    /// Two batched GEMMs around a memory-bound softmax/mask/dropout over the s×s scores.
    Unfused,
}

/// Precision of the stored gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GradPrecision {
    /// As the weights ([`Precision::bytes`]).
    #[default]
    Param,
    /// FP32 (4 bytes).
    Fp32,
    /// A gradient like the weights plus an FP32 accumulation copy (DeepSpeed's BF16 optimizer
    /// keeps both): 2 + 4 bytes held, the FP32 copy reduced.
    ParamAndFp32,
}

fn d_true() -> bool {
    true
}

fn d_eff() -> f64 {
    0.6
}
fn d_overlap() -> f64 {
    0.75
}

/// The `[checkpoint]` table (000 P10; 004 eqs. 28.19–28.25).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Planned interval between checkpoints, seconds.
    pub interval_s: Option<f64>,
    /// Pause per checkpoint C, seconds; default: state bytes / cluster storage write bandwidth.
    pub write_s: Option<f64>,
    /// Window the checkpoint must persist within, seconds (004 example 27.2: 120 s).
    pub window_s: Option<f64>,
    /// Recovery time R_f after a failure, seconds.
    #[serde(default)]
    pub restart_s: f64,
}

/// The `[data]` table (000 eqs. 4.1–4.3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    /// Bytes read from storage per sequence (4 B per token ID for pre-tokenized text).
    pub bytes_per_sample: f64,
    /// P99 latency of fetching one local batch, seconds.
    pub io_p99_s: f64,
    /// Prefetch depth Q in batches.
    pub prefetch_depth: u64,
}

/// The job as written in TOML.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    /// Model.
    pub model: ModelFile,
    /// Training.
    pub training: TrainingFile,
    /// A fixed layout to evaluate (omit and use `--search`).
    pub layout: Option<Layout>,
    /// Checkpointing.
    pub checkpoint: Option<CheckpointSpec>,
    /// Data pipeline.
    pub data: Option<DataSpec>,
}

impl JobFile {
    /// Parses TOML text.
    pub fn from_toml(text: &str) -> Result<JobFile> {
        toml::from_str(text).map_err(|e| PlanError::Parse {
            what: "job TOML".into(),
            message: e.to_string(),
        })
    }

    /// A job for a model preset with default training settings.
    pub fn preset(model: &str, global_batch: u64) -> JobFile {
        JobFile {
            model: ModelFile {
                preset: Some(model.into()),
                ..ModelFile::default()
            },
            training: TrainingFile {
                global_batch,
                precision: Precision::Bf16,
                optimizer: Optimizer::Adam,
                optimizer_bytes_per_param: None,
                tokens: 0.0,
                efficiency: d_eff(),
                dp_overlap: d_overlap(),
                critical_batch: None,
                deadline_days: None,
                compute_model: ComputeModel::Roofline,
                attention: AttentionKernel::Flash,
                causal: true,
                grad_precision: GradPrecision::Param,
                grad_comm_precision: GradCommPrecision::Grad,
                pipeline_engine: PipelineEngine::Megatron,
            },
            layout: None,
            checkpoint: None,
            data: None,
        }
    }
}

/// A validated job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// Model shape.
    pub model: ModelShape,
    /// Global batch, sequences.
    pub global_batch: u64,
    /// Precision.
    pub precision: Precision,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// K, optimizer bytes per parameter.
    pub optimizer_bytes: f64,
    /// Tokens to train.
    pub tokens: f64,
    /// Matmul efficiency factor.
    pub efficiency: f64,
    /// DP overlap fraction.
    pub dp_overlap: f64,
    /// Critical batch, sequences.
    pub critical_batch: Option<f64>,
    /// Deadline, seconds.
    pub deadline_s: Option<f64>,
    /// Fixed layout, if any.
    pub layout: Option<Layout>,
    /// Checkpointing.
    pub checkpoint: Option<CheckpointSpec>,
    /// Data pipeline.
    pub data: Option<DataSpec>,
    /// How compute is priced.
    pub compute_model: ComputeModel,
    /// Attention kernel.
    pub attention: AttentionKernel,
    /// Causal attention.
    pub causal: bool,
    /// Gradient precision.
    pub grad_precision: GradPrecision,
    /// Precision of the data-parallel reduction.
    pub grad_comm_precision: GradCommPrecision,
    /// Pipeline engine.
    pub pipeline_engine: PipelineEngine,
}

/// Largest global batch accepted, in sequences (2^32: far beyond any job, and small enough
/// that tokens per step stay exact in f64).
pub const MAX_GLOBAL_BATCH: f64 = 4_294_967_296.0;
/// Largest number of tokens to train accepted (1e18: about 10^5 times Llama 3's 15e12).
pub const MAX_TOKENS: f64 = 1e18;

impl Job {
    /// Resolves the model and validates every number.
    pub fn from_file(f: &JobFile) -> Result<Job> {
        let model = f.model.resolve()?;
        let t = &f.training;
        at_least_one("training.global_batch", t.global_batch)?;
        at_most(
            "training.global_batch",
            t.global_batch as f64,
            MAX_GLOBAL_BATCH,
            "sequences per step",
        )?;
        let optimizer_bytes = match t.optimizer_bytes_per_param {
            Some(k) => non_negative("training.optimizer_bytes_per_param", k)?,
            None => t.optimizer.state_bytes(t.precision),
        };
        positive("training.efficiency", t.efficiency)?;
        fraction("training.efficiency", t.efficiency)?;
        fraction("training.dp_overlap", t.dp_overlap)?;
        non_negative("training.tokens", t.tokens)?;
        at_most("training.tokens", t.tokens, MAX_TOKENS, "tokens to train")?;
        if let Some(b) = t.critical_batch {
            positive("training.critical_batch", b)?;
        }
        let deadline_s = t
            .deadline_days
            .map(|d| positive("training.deadline_days", d))
            .transpose()?;
        if let Some(c) = &f.checkpoint {
            for (field, v) in [
                ("checkpoint.interval_s", c.interval_s),
                ("checkpoint.write_s", c.write_s),
                ("checkpoint.window_s", c.window_s),
            ] {
                if let Some(v) = v {
                    positive(field, v)?;
                }
            }
            non_negative("checkpoint.restart_s", c.restart_s)?;
        }
        if let Some(d) = &f.data {
            positive("data.bytes_per_sample", d.bytes_per_sample)?;
            non_negative("data.io_p99_s", d.io_p99_s)?;
        }
        Ok(Job {
            model,
            global_batch: t.global_batch,
            precision: t.precision,
            optimizer: t.optimizer,
            optimizer_bytes,
            tokens: t.tokens,
            efficiency: t.efficiency,
            dp_overlap: t.dp_overlap,
            critical_batch: t.critical_batch,
            deadline_s: deadline_s.map(|d| d * 86_400.0),
            layout: f.layout.clone(),
            checkpoint: f.checkpoint.clone(),
            data: f.data.clone(),
            compute_model: t.compute_model,
            attention: t.attention,
            causal: t.causal,
            grad_precision: t.grad_precision,
            grad_comm_precision: t.grad_comm_precision,
            pipeline_engine: t.pipeline_engine,
        })
    }

    /// Bytes of one stored gradient element: the weights' bytes, or 4 with FP32 gradients.
    pub fn grad_bytes(&self) -> f64 {
        match self.grad_precision {
            GradPrecision::Param => self.precision.bytes(),
            GradPrecision::Fp32 => 4.0,
            GradPrecision::ParamAndFp32 => self.precision.bytes() + 4.0,
        }
    }

    /// Bytes per gradient element the data-parallel reduction moves: the weights' bytes, or 4
    /// when an FP32 gradient is kept, unless the reduction casts to the weights' precision
    /// ([`GradCommPrecision::Param`]).
    pub fn grad_comm_bytes(&self) -> f64 {
        match (self.grad_precision, self.grad_comm_precision) {
            (GradPrecision::Param, _) | (_, GradCommPrecision::Param) => self.precision.bytes(),
            (GradPrecision::Fp32 | GradPrecision::ParamAndFp32, GradCommPrecision::Grad) => 4.0,
        }
    }

    /// Bytes per parameter of the transient copy the reduction makes when it casts the kept
    /// gradient to another precision (DeepSpeed's `allreduce_bucket`: `tensor.to(...)` of the
    /// whole flat FP32 buffer, which is one bucket): 0 when it reduces in place.
    pub fn grad_comm_cast_bytes(&self) -> f64 {
        match (self.grad_precision, self.grad_comm_precision) {
            (GradPrecision::Fp32 | GradPrecision::ParamAndFp32, GradCommPrecision::Param) => {
                self.precision.bytes()
            }
            _ => 0.0,
        }
    }

    /// Tokens per step: B·s.
    pub fn tokens_per_step(&self) -> f64 {
        self.global_batch as f64 * self.model.seq as f64
    }
}
