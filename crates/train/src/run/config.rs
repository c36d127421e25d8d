//! The typed run configuration: what one training run is (the model and optimizer in
//! [`TrainConfig`], the parallel layout, checkpoints, metrics and outputs), produced by the
//! command line and checked before any worker starts.
use std::path::PathBuf;

use comm::mesh::MeshShape;

use crate::checkpoint::CheckpointConfig;
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::pipeline::ScheduleKind;
use crate::run::expert::check_moe;
use crate::run::init::{Init, check_layout as check_init};
use model::interop::HfDtype;

/// Gradient bucket size of data-parallel runs (see [`crate::ddp`]), 1 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 1 << 20;

/// How a run is laid out over its ranks: a `dp x pp x tp` device mesh (TP fastest, then DP,
/// stages outermost; [`comm::mesh::DeviceMesh`]), with ZeRO over the data-parallel axis.
#[derive(Clone, Debug, PartialEq)]
pub struct LayoutConfig {
    /// Tensor-parallel degree (1: off).
    pub tp: usize,
    /// Megatron sequence parallelism inside the TP group (000 L3239): the residual stream,
    /// norms and block outputs split by rows over the `tp` ranks.
    pub sp: bool,
    /// Pipeline stages (1: off).
    pub pp: usize,
    /// The pipeline's schedule.
    pub schedule: ScheduleKind,
    /// ZeRO stage over the data-parallel axis: 0 (off), 1, 2 or 3.
    pub zero: u8,
    /// Data-parallel gradient bucket size, bytes.
    pub bucket_bytes: usize,
    /// Run even when a TP group spans hosts (the refusal becomes a warning).
    pub force_placement: bool,
    /// Hybrid sharding (HSDP): ZeRO inside groups of `.0` data-parallel ranks, replicated
    /// across `.1` groups (either may be implied by the world); `(None, None)`: off.
    pub hybrid: (Option<usize>, Option<usize>),
    /// Expert-parallel degree over the data-parallel axis (1: every rank computes every
    /// expert; needs experts in the model, [`model::config::MoeSpec`]).
    pub ep: usize,
}

impl Default for LayoutConfig {
    fn default() -> Self {
        Self {
            tp: 1,
            sp: false,
            pp: 1,
            schedule: ScheduleKind::OneFOneB,
            zero: 0,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            force_placement: false,
            hybrid: (None, None),
            ep: 1,
        }
    }
}

impl LayoutConfig {
    /// Hybrid sharding's (shard group size, replica groups) over `world` data-parallel
    /// ranks, validated with the equation; None when it is off.
    pub fn hybrid_groups(&self, world: usize) -> Result<Option<(usize, usize)>> {
        let (shard, replicate) = match self.hybrid {
            (None, None) => return Ok(None),
            (Some(s), None) => (s, world / s.max(1)),
            (None, Some(r)) => (world / r.max(1), r),
            (Some(s), Some(r)) => (s, r),
        };
        if self.zero == 0 {
            return Err(refused(
                "--dp-shard / --dp-replicate: hybrid sharding shards the ZeRO state inside \
                 groups; add --zero 1, 2 or 3"
                    .into(),
            ));
        }
        if self.splits_model() {
            return Err(refused(format!(
                "--dp-shard / --dp-replicate with --tp {} --pp {}: hybrid sharding is built for \
                 data parallelism alone so far",
                self.tp, self.pp
            )));
        }
        if shard == 0 || replicate == 0 || shard * replicate != world {
            return Err(refused(format!(
                "--dp-shard {shard} x --dp-replicate {replicate} = {} must equal the \
                 data-parallel world of {world} workers (nproc x nnodes)",
                shard * replicate
            )));
        }
        Ok(Some((shard, replicate)))
    }

    /// Whether the run splits the model (TP or PP), which takes the mesh engines.
    pub fn splits_model(&self) -> bool {
        self.tp > 1 || self.pp > 1
    }

    /// The mesh of a `world`-rank job, validated with the equation in the error.
    pub fn shape(&self, world: usize) -> Result<MeshShape> {
        if self.tp == 0 || self.pp == 0 {
            return Err(refused(format!(
                "--tp {} --pp {}: degrees must be at least 1",
                self.tp, self.pp
            )));
        }
        let mp = self.tp * self.pp;
        if !world.is_multiple_of(mp) {
            return Err(refused(format!(
                "--tp {} x --pp {} = {mp} does not divide the world of {world} workers \
                 (nproc x nnodes); dp = world / (tp x pp) must be whole",
                self.tp, self.pp
            )));
        }
        let shape = MeshShape::new(world / mp, self.pp, self.tp);
        shape.validate(world).map_err(|e| refused(e.to_string()))?;
        Ok(shape)
    }
}

/// Everything one training run needs besides its ranks.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Model, batch, optimizer, schedule, data.
    pub train: TrainConfig,
    /// The parallel layout.
    pub layout: LayoutConfig,
    /// Where and how the run checkpoints (and resumes from), if it does.
    pub checkpoint: Option<CheckpointConfig>,
    /// Append per-step metrics and a summary to this file as JSON lines (lead rank).
    pub metrics: Option<PathBuf>,
    /// Report a step every this many steps (and the first and last).
    pub log_every: u64,
    /// This rank's MFU denominator, GFLOP/s (None: measure this machine's 2048^3 GEMM).
    pub peak_gflops: Option<f64>,
    /// Set the planner's forecast beside the measured step at the end.
    pub forecast: bool,
    /// Save the trained model (Flotilla names) to this directory.
    pub save: Option<PathBuf>,
    /// Export the trained model in Hugging Face layout to this directory.
    pub export_hf: Option<PathBuf>,
    /// The dtype of the exported weights.
    pub export_dtype: HfDtype,
    /// Where the parameters start (the seed, or a Hugging Face directory to fine-tune).
    pub init: Init,
    /// The launcher's restart generation this run belongs to (0 for a first run).
    pub generation: u64,
    /// Measure the validation loss on the held-out split every this many steps and after the
    /// last (0: never; see [`crate::run::eval`]).
    pub eval_every: u64,
    /// Batches of the held-out split per evaluation.
    pub eval_batches: usize,
    /// Write a Chrome / Perfetto trace per rank in this directory (see `run::trace`).
    pub trace: Option<PathBuf>,
    /// The object store the checkpoint directory mirrors (`s3://bucket/prefix`; the
    /// checkpoint directory is then its local cache; see [`crate::run::mirror`]).
    pub ckpt_remote: Option<String>,
}

impl RunConfig {
    /// A run of `train` on one layout with no checkpoints, metrics or outputs.
    pub fn new(train: TrainConfig, layout: LayoutConfig) -> Self {
        Self {
            train,
            layout,
            checkpoint: None,
            metrics: None,
            log_every: 10,
            peak_gflops: None,
            forecast: false,
            save: None,
            export_hf: None,
            export_dtype: HfDtype::F32,
            init: Init::Seed,
            generation: 0,
            eval_every: 0,
            eval_batches: 4,
            trace: None,
            ckpt_remote: None,
        }
    }

    /// Checks what can be checked before any worker starts, for a job of `world` ranks: the
    /// mesh degrees (with the equation), and every setting this layout does not honour,
    /// refused with the reason (for MoE runs, [`check_moe`]).
    pub fn check(&self, world: usize) -> Result<()> {
        self.train.validate()?;
        super::eval::check(self)?;
        check_init(&self.init, self.layout.pp, self.train.model.moe.is_some())?;
        check_moe(self, world)?;
        if world > 1
            && self
                .checkpoint
                .as_ref()
                .is_some_and(|c| c.auto_mtbf.is_some())
        {
            // Each rank would time its own saves and the ranks could disagree on when to save.
            return Err(refused(format!(
                "--ckpt-auto-mtbf with {world} workers: the automatic interval is single-process \
                 only so far; use --ckpt-every"
            )));
        }
        let l = &self.layout;
        l.hybrid_groups(world)?;
        if l.sp && l.tp < 2 {
            return Err(refused(format!(
                "--sp with --tp {}: sequence parallelism splits the rows over a TP group; \
                 use --tp 2 or more",
                l.tp
            )));
        }
        if l.sp && !(self.train.batch * self.train.seq_len).is_multiple_of(l.tp) {
            return Err(refused(format!(
                "--sp with --tp {}: each TP rank keeps rows/tp rows, but batch x seq_len = {} x \
                 {} = {} rows does not divide by {}",
                l.tp,
                self.train.batch,
                self.train.seq_len,
                self.train.batch * self.train.seq_len,
                l.tp
            )));
        }
        if l.bucket_bytes == 0 {
            return Err(refused("--bucket-mb: must be positive".into()));
        }
        let t = &self.train;
        if l.zero > 3 {
            return Err(refused(format!(
                "--zero {}: stages are 0, 1, 2 and 3",
                l.zero
            )));
        }
        if l.zero != 0 && t.bf16 && l.pp > 1 {
            return Err(refused(format!(
                "--zero {} with --bf16 and --pp {}: pipeline stages shard f32 moments only; bf16 \
                 with ZeRO in pipelines is not built yet",
                l.zero, l.pp
            )));
        }
        if l.splits_model() {
            l.shape(world)?;
            // The stages' own check (pipeline::build), made here so that no worker starts.
            let v = l.schedule.virtual_stages().max(1);
            let chunks = l.pp.saturating_mul(v);
            if l.pp > 1 && chunks > t.model.layers {
                return Err(refused(format!(
                    "--pp {} x {v} chunk(s) per stage = {chunks} pipeline chunks, but the model \
                     has {} blocks (--layers): every chunk needs at least one block, layers >= \
                     pp x chunks per stage",
                    l.pp, t.model.layers
                )));
            }
            if world == 1 {
                return Err(refused(
                    "--tp/--pp split the model over workers: run with --nproc 2 or more".into(),
                ));
            }
            // What the mesh engines build, refused here rather than in every worker.
            if l.pp > 1 && l.zero > 1 {
                return Err(refused(format!(
                    "--zero {} with --pp {} (ZeRO-1 is built): not built for the mesh engines yet",
                    l.zero, l.pp
                )));
            }
        } else if l.zero != 0 && world == 1 {
            return Err(refused(format!(
                "--zero {}: ZeRO shards the state over data-parallel ranks; run it with --nproc 2 \
                 or more",
                l.zero
            )));
        }
        Ok(())
    }
}

/// A refusal with `reason`.
pub(crate) fn refused(reason: String) -> TrainError {
    TrainError::Refused(reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(tp: usize, pp: usize) -> LayoutConfig {
        LayoutConfig {
            tp,
            pp,
            ..LayoutConfig::default()
        }
    }

    #[test]
    fn degrees_are_checked_with_the_equation() {
        let s = layout(2, 1).shape(4).unwrap();
        assert_eq!((s.dp, s.pp, s.tp), (2, 1, 2));
        let s = layout(1, 2).shape(8).unwrap();
        assert_eq!((s.dp, s.pp, s.tp), (4, 2, 1));
        let e = layout(3, 1).shape(4).unwrap_err();
        assert!(e.is_refusal());
        let e = e.to_string();
        assert!(
            e.contains("--tp 3 x --pp 1 = 3 does not divide the world of 4"),
            "{e}"
        );
        let s = layout(2, 2).shape(8).unwrap();
        assert_eq!((s.dp, s.pp, s.tp), (2, 2, 2));
        assert!(layout(0, 1).shape(4).is_err());
        assert!(!layout(1, 1).splits_model() && layout(2, 1).splits_model());
    }

    #[test]
    fn a_pipeline_needs_a_block_per_chunk() {
        let mut train = TrainConfig::new(model::config::ModelConfig::preset("tiny").unwrap(), 1);
        train.model.layers = 1;
        let cfg = RunConfig::new(train.clone(), layout(1, 2));
        let e = cfg.check(2).unwrap_err();
        assert!(e.is_refusal());
        assert!(
            e.to_string().contains("--pp 2 x 1 chunk(s) per stage = 2"),
            "{e}"
        );
        train.model.layers = 2;
        assert!(RunConfig::new(train.clone(), layout(1, 2)).check(2).is_ok());
        let mut interleaved = layout(1, 2);
        interleaved.schedule = ScheduleKind::Interleaved { virtual_stages: 2 };
        let e = RunConfig::new(train, interleaved).check(2).unwrap_err();
        assert!(e.to_string().contains("= 4 pipeline chunks"), "{e}");
    }

    #[test]
    fn schedules_parse() {
        let p = |s: &str| s.parse::<ScheduleKind>();
        assert_eq!(p("1f1b"), Ok(ScheduleKind::OneFOneB));
        assert_eq!(p("gpipe"), Ok(ScheduleKind::GPipe));
        assert_eq!(
            p("interleaved:2"),
            Ok(ScheduleKind::Interleaved { virtual_stages: 2 })
        );
        for bad in ["interleaved:0", "interleaved:x", "zb"] {
            assert!(p(bad).unwrap_err().contains(bad), "{bad}");
        }
    }
}
