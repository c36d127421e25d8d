//! Saving a training run into distributed checkpoints (flotilla-ckpt) and resuming from them.
//!
//! What a step's checkpoint holds (004 §28.6: model, optimizer, scheduler, RNG and data cursor):
//! - tensors, one per entry of the model's layout table, all float32 in the entry's shape:
//!   `model.<entry>` (the f32 master weights under bf16), `optim.exp_avg.<entry>` and
//!   `optim.exp_avg_sq.<entry>` (AdamW's moments);
//! - state: the step, AdamW's step count, the number of batches and of rows drawn from the data
//!   source (the rows are the global cursor of the built-in corpora, whose stream is one row
//!   after another: a resume skips them, on any number of ranks) and, for token datasets, the
//!   loader's own state (its global sample cursor, which also survives a change of ranks); the model config (as the safetensors metadata map of
//!   `model::interop::config_to_metadata`, so `flotilla ckpt convert` can rebuild the model) and
//!   the hash of the training config. The learning-rate schedule is a pure function of the step
//!   and parameter initialisation happens once, so neither has state of its own.
//!
//! Resuming with the same config and thread count continues bit-identically: the test
//! `resume_is_bit_identical` trains 6 steps straight and 3 + save + resume + 3, and compares
//! every parameter bit.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ckpt::policy::IntervalPlanner;
use ckpt::{
    AsyncSaver, Checkpoint, CheckpointMeta, DType, RankWriter, Slice, TensorMeta, f32_bytes,
};
use serde_json::json;

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::expert::share_pieces;
use crate::trainer::{StepStats, Trainer};
use crate::zero::state::{StatePiece, flat_boxes};
use model::layout::{Layout, ParamEntry};
use std::ops::Range;

mod collective;
mod fallback;
mod hf_export;
mod run_state;

pub(crate) use collective::{
    check_state_tensors, newest_committed, read_state_range, read_whole_state, save_collectively,
    saved_run,
};
pub(crate) use fallback::clear_leftovers;
pub use fallback::resume_collectively;
pub use hf_export::{HfExport, export_hf, model_config};
pub(crate) use run_state::SavedRun;
pub use run_state::{MAX_REPLICAS, MAX_ROWS_PER_STEP_FACTOR, RunState};

/// Prefix of the parameter tensors.
pub const MODEL_PREFIX: &str = "model.";
/// Prefix of AdamW's first moments.
pub const EXP_AVG_PREFIX: &str = "optim.exp_avg.";
/// Prefix of AdamW's second moments.
pub const EXP_AVG_SQ_PREFIX: &str = "optim.exp_avg_sq.";
/// Longest wait for a background save before the run reports it stuck.
pub const SAVE_TIMEOUT: Duration = Duration::from_secs(1800);

/// Hash of everything in the training config that decides the numbers, i.e. all but the number
/// of steps (a resumed run may go further), the thread count (which can change the reduction
/// order: bit-identical resumes need the same count, but a different one is allowed) and the
/// gradient accumulation: like the number of ranks, it only sets how many rows of the stream
/// one step takes (`batch x ranks x grad_accum`), and an elastic resume may change either (to
/// keep the global batch when ranks are lost, raise the accumulation).
pub fn config_hash(cfg: &TrainConfig) -> String {
    let mut c = cfg.clone();
    c.steps = 0;
    c.threads = 0;
    c.grad_accum = 1;
    if let crate::config::DataSpec::Dataset { loader, .. } = &mut c.data {
        // Where a remote dataset is cached decides no number.
        loader.cache = data::CacheConfig::default();
    }
    ckpt::checksum_hex(format!("{c:?}").as_bytes())
}

/// The run id a training run's checkpoints record (`train-seed<seed>`): the same for every
/// layout, so a checkpoint names the run whichever engine saved it.
pub fn run_id(cfg: &TrainConfig) -> String {
    format!("train-seed{}", cfg.seed)
}

/// How a run checkpoints.
#[derive(Clone, Debug)]
pub struct CheckpointConfig {
    /// Root directory of the run's checkpoints.
    pub dir: PathBuf,
    /// Save every this many steps (0: only at the end, unless `auto_mtbf` is set).
    pub every: u64,
    /// Save asynchronously (copy to host buffers, write in the background).
    pub asynchronous: bool,
    /// Automatic interval: the job's mean time between failures in seconds. Checkpoints are
    /// then taken every tau* = sqrt(2 C M) seconds (004 eq. 28.24), C being the measured
    /// foreground pause of the saves so far (a prior of [`AUTO_PAUSE_PRIOR_SECS`] before the
    /// first).
    pub auto_mtbf: Option<f64>,
}

/// Pause assumed by the automatic interval before the first save has been measured.
pub const AUTO_PAUSE_PRIOR_SECS: f64 = 1.0;

/// One save as the trainer saw it.
#[derive(Clone, Debug)]
pub struct SaveSummary {
    /// Step saved.
    pub step: u64,
    /// Bytes of tensor data.
    pub bytes: u64,
    /// Time the training loop was blocked by the save.
    pub pause: Duration,
    /// Under the automatic interval: the interval now planned (seconds) and the expected loss
    /// fraction at it (004 eq. 28.23).
    pub planned: Option<(f64, f64)>,
}

/// The checkpoint tensors of a model state: for every layout entry, its slice of `master`, `m`
/// and `v` under the [`MODEL_PREFIX`], [`EXP_AVG_PREFIX`] and [`EXP_AVG_SQ_PREFIX`] names.
pub(crate) fn state_views<'a>(
    layout: &Layout,
    master: &'a [f32],
    m: &'a [f32],
    v: &'a [f32],
) -> Vec<(TensorMeta, &'a [u8])> {
    let bufs = [master, m, v];
    state_metas(layout)
        .into_iter()
        .enumerate()
        .map(|(i, meta)| {
            let e = &layout.entries[i % layout.entries.len()];
            (meta, f32_bytes(&bufs[i / layout.entries.len()][e.range()]))
        })
        .collect()
}

/// The checkpoint tensors of `layout`'s state, in order: every entry under [`MODEL_PREFIX`],
/// then under [`EXP_AVG_PREFIX`] and [`EXP_AVG_SQ_PREFIX`].
pub fn state_metas(layout: &Layout) -> Vec<TensorMeta> {
    let mut out = Vec::with_capacity(3 * layout.entries.len());
    for prefix in [MODEL_PREFIX, EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX] {
        for e in &layout.entries {
            out.push(TensorMeta {
                name: format!("{prefix}{}", e.name),
                dtype: DType::F32,
                shape: e.shape.iter().map(|&d| d as u64).collect(),
            });
        }
    }
    out
}

impl Trainer {
    /// The tensors of a checkpoint of the current step, each with its bytes (whole-state
    /// trainers; a ZeRO rank holds only parts: [`Trainer::checkpoint_pieces`]).
    pub fn checkpoint_tensors(&self) -> Vec<(TensorMeta, &[u8])> {
        let (m, v) = self.optimizer().moments();
        state_views(self.model().layout(), self.master_params(), m, v)
    }

    /// The pieces this rank, `rank` of `world`, writes of the current step: its rows of every
    /// tensor ([`ckpt::rank_rows`]) when every rank holds the whole state, or its owned parts
    /// under ZeRO. Each names its tensor by index into [`state_metas`].
    ///
    /// A tensor-parallel rank writes only its shards, as boxes of the whole tensors
    /// ([`crate::tensor::TpPart::place`]; replicated tensors by TP rank 0): under ZeRO its
    /// owned parts of them, else every `world`-th of its pieces (the replicas hold the same
    /// shards and share the writing; `rank`, `world` are then the data-parallel ones).
    pub fn checkpoint_pieces(&self, rank: u32, world: u32) -> Vec<StatePiece<'_>> {
        let (m, v) = self.optimizer().moments();
        let layout = self.model().layout();
        let whole = |e: &ParamEntry, r: Range<usize>| flat_boxes(&e.shape, r);
        let sharded = |e: &ParamEntry, r: Range<usize>| match &self.tensor {
            Some(t) => t.place(e, r),
            None => whole(e, r),
        };
        if let Some(z) = self.zero_engine() {
            let mine = z.state_pieces(layout, (self.params(), m, v), &sharded);
            // Hybrid sharding: the replica groups hold the same parts and share the writing.
            return match z.replicas() {
                // Under --ft one replica group (the quorum's first) writes everything.
                Some(r @ crate::zero::Replicas::Group(_)) => mine
                    .into_iter()
                    .enumerate()
                    .filter(|(k, _)| k % r.size() == r.rank())
                    .map(|(_, p)| p)
                    .collect(),
                _ => mine,
            };
        }
        if self.tensor.is_none() {
            let owners = self.expert_owners();
            return share_pieces(&self.checkpoint_tensors(), &owners, rank, world);
        }
        let n = layout.entries.len();
        let bufs = [self.master_params(), m, v];
        let owners = self.expert_owners();
        // The replicas share the writing of what they all hold; an expert comes from its owner.
        let (mut shared, mut own) = (Vec::new(), Vec::new());
        for (which, buf) in bufs.iter().enumerate() {
            for (i, e) in layout.entries.iter().enumerate() {
                let to = match owners[i] {
                    Some(false) => continue,
                    Some(true) => &mut own,
                    None => &mut shared,
                };
                for (slice, sub) in sharded(e, 0..e.numel()) {
                    let at = e.offset + sub.start;
                    to.push((which * n + i, slice, f32_bytes(&buf[at..at + sub.len()])));
                }
            }
        }
        let (rank, world) = (rank as usize, world.max(1) as usize);
        shared
            .into_iter()
            .enumerate()
            .filter(|(k, _)| k % world == rank)
            .map(|(_, p)| p)
            .chain(own)
            .collect()
    }

    /// Everything but the tensors: run id, layout and the non-tensor state (see the module doc).
    pub fn checkpoint_meta(&mut self, run_id: &str) -> CheckpointMeta {
        let tensors = state_metas(self.whole_layout());
        let loader = self.source_mut().loader_state().map(|s| s.to_json());
        let state = RunState {
            step: self.steps_done(),
            optimizer_step: self.optimizer().step_count(),
            batches_drawn: self.batches_drawn(),
            rows_drawn: self.rows_drawn(),
            loader,
            world: self.world(),
            config: self.config(),
        }
        .to_json();
        CheckpointMeta {
            run_id: run_id.to_string(),
            world_size: 1,
            layout: match (self.zero_stage(), self.tp()) {
                (Some(stage), 1) => {
                    json!({"dp": 1, "tp": 1, "pp": 1, "split": "zero-flat", "zero": stage.number()})
                }
                (None, 1) => json!({"dp": 1, "tp": 1, "pp": 1, "split": "dim0"}),
                (stage, tp) => json!({
                    "dp": self.world(),
                    "tp": tp,
                    "pp": 1,
                    "split": "tp-shards",
                    "zero": stage.map_or(0, |s| s.number()),
                }),
            },
            config_hash: config_hash(self.config()),
            tensors,
            state,
        }
    }

    /// Loads `ckpt` into this trainer: parameters, optimizer moments and step, and the data
    /// source's position. Refused, naming what differs, if it was saved under another config.
    ///
    /// A tensor-parallel rank reads the whole tensors and keeps its shards (moments alike).
    pub fn restore(&mut self, ckpt: &Checkpoint) -> Result<()> {
        check_state_tensors(ckpt, self.whole_layout())?;
        let run = saved_run(ckpt, self.config())?;
        let state = read_whole_state(ckpt, self.whole_layout())?;
        self.load_whole_state(state, run.optimizer_step, run.step)?;
        self.reset_source(run.loader.as_ref(), run.rows)
    }

    /// Replaces the state with the whole model's `[parameters, first moments, second moments]`
    /// (each [`Trainer::whole_layout`]'s length) and the step counters: a tensor-parallel rank
    /// keeps its shards, ZeRO its part, bf16 its rounded copy. A checkpoint's restore and a
    /// fine-tuning start ([`crate::run::init`]) both load through it.
    pub(crate) fn load_whole_state(
        &mut self,
        mut state: [Vec<f32>; 3],
        optimizer_step: u64,
        step: u64,
    ) -> Result<()> {
        if let Some(t) = &self.tensor {
            for buf in state.iter_mut() {
                let mut mine = vec![0f32; t.layout.total];
                t.layout.shard_params(buf, &mut mine)?;
                *buf = mine;
            }
        }
        // Another rank's experts stay at zero here (their owner holds them).
        if let Some(p) = &self.experts {
            state.iter_mut().for_each(|buf| p.zero_within(buf, 0));
        }
        let [master, m, v] = state;
        self.load_state(master, m, v, optimizer_step, step)
    }

    /// The whole model's layout: the tensors a checkpoint of this trainer holds (a
    /// tensor-parallel rank's buffer is a split of it).
    pub fn whole_layout(&self) -> &Layout {
        match &self.tensor {
            Some(t) => &t.layout.whole,
            None => self.model().layout(),
        }
    }
}

/// Drives a run's checkpoints: decides when a step is due (every `every` steps, or the
/// automatic Young/Daly interval), saves it and commits it once its file is durable.
///
/// Asynchronous saves overlap the training step that follows the one saved: the state after
/// step k is staged into the saver's host buffer by a second thread while step k + 1 runs its
/// forward and backward (which only read that state), and the optimizer of step k + 1 waits for
/// the copy ([`Trainer::step_with_staging`]); the file is then written and committed in the
/// background. The pause the training loop sees is only the part of the copy that outlasts the
/// forward and backward. A save due at the last step is staged in the foreground by
/// [`Checkpointer::finish`].
pub struct Checkpointer {
    cfg: CheckpointConfig,
    run_id: String,
    saver: Option<AsyncSaver>,
    last_saved: Option<u64>,
    /// The automatic interval's planner and the time of the last save (or of the start).
    planner: Option<(IntervalPlanner, Instant)>,
    /// A due step to stage during the next training step, with its metadata.
    pending: Option<(u64, CheckpointMeta)>,
    /// Whether the host buffer has been mapped ([`Checkpointer::prepare`]).
    prepared: bool,
    /// This rank and the number of ranks saving together ([`Checkpointer::with_shard`]).
    rank: u32,
    world: u32,
}

impl Checkpointer {
    /// Where and how it saves.
    pub fn config(&self) -> &CheckpointConfig {
        &self.cfg
    }

    /// A checkpointer writing under `cfg.dir` (created if missing).
    pub fn new(cfg: CheckpointConfig, run_id: &str) -> Result<Self> {
        std::fs::create_dir_all(&cfg.dir).map_err(|e| TrainError::Config {
            field: "checkpoint dir",
            value: cfg.dir.display().to_string(),
            reason: e.to_string(),
        })?;
        let saver = cfg.asynchronous.then(|| AsyncSaver::new(&cfg.dir, 0));
        let planner = match cfg.auto_mtbf {
            Some(m) => Some((
                IntervalPlanner::new(AUTO_PAUSE_PRIOR_SECS, m).map_err(ckpt::CkptError::from)?,
                Instant::now(),
            )),
            None => None,
        };
        Ok(Checkpointer {
            cfg,
            run_id: run_id.to_string(),
            saver,
            last_saved: None,
            planner,
            pending: None,
            prepared: false,
            rank: 0,
            world: 1,
        })
    }

    /// Saves as rank `rank` of `world` data-parallel ranks that hold the same state: each writes
    /// its [`ckpt::rank_rows`] of every tensor, in parallel, and rank 0 commits once every
    /// rank's piece list has arrived ([`ckpt::handoff`]). Every rank must call
    /// [`Checkpointer::step`] and [`Checkpointer::finish`] alike. The automatic interval is
    /// refused here (each rank would time its own saves and they could disagree).
    pub fn with_shard(mut self, rank: u32, world: u32) -> Result<Self> {
        if world > 1 && self.planner.is_some() {
            return Err(TrainError::Config {
                field: "checkpoint interval",
                value: "auto".into(),
                reason: format!(
                    "the automatic interval is single-process only for now ({world} ranks)"
                ),
            });
        }
        if rank >= world {
            return Err(TrainError::Config {
                field: "checkpoint rank",
                value: rank.to_string(),
                reason: format!("must be below the {world} ranks"),
            });
        }
        if let Some(saver) = self.saver.take() {
            drop(saver);
            self.saver = Some(AsyncSaver::new(&self.cfg.dir, rank));
        }
        self.rank = rank;
        self.world = world;
        Ok(self)
    }

    /// [`Checkpointer::commit_after`] for the data-parallel engine, whose `world` ranks are
    /// its data-parallel degree.
    fn after_write(&self, mut meta: CheckpointMeta) -> ckpt::AfterWrite {
        meta.world_size = self.world;
        meta.layout["dp"] = self.world.into();
        self.commit_after(meta)
    }

    /// What runs once this rank's file is durable: commit (one rank), publish the piece list
    /// (ranks 1..), or collect every list and commit (rank 0 of several).
    fn commit_after(&self, meta: CheckpointMeta) -> ckpt::AfterWrite {
        let (root, rank, world) = (self.cfg.dir.clone(), self.rank, self.world);
        Box::new(move |step, pieces| {
            if rank != 0 {
                return ckpt::handoff::publish_pieces(&root, step, rank, &pieces);
            }
            let all = ckpt::handoff::collect_pieces(&root, step, world, pieces, SAVE_TIMEOUT)?;
            ckpt::commit(&root, step, all, meta).map(drop)
        })
    }

    /// Restores `trainer` from the newest checkpoint under `dir` that loads: a step whose
    /// marker, manifest or any tensor byte fails verification is set aside with
    /// [`ckpt::quarantine`] and the one before it tried (the trainer is only changed once every
    /// tensor of a step has been read and verified). Returns the step resumed from and the
    /// newer steps that were rejected (with why), or `None` when `dir` holds no committed step.
    /// A checkpoint of another training config is an error, not a reason to fall back.
    pub fn resume(dir: &Path, trainer: &mut Trainer) -> Result<Option<(u64, Vec<String>)>> {
        fallback::resume_alone(dir, |c| trainer.restore(c))
    }

    /// Maps the asynchronous saver's host buffer for `trainer`'s state now (done by the first
    /// [`Checkpointer::step`] otherwise), so no save pays for it; returns the time taken (zero
    /// for synchronous saves or when already done).
    pub fn prepare(&mut self, trainer: &Trainer) -> Result<Duration> {
        let start = Instant::now();
        if let Some(saver) = &mut self.saver {
            let bytes = trainer
                .checkpoint_pieces(self.rank, self.world)
                .iter()
                .map(|(_, _, b)| b.len())
                .sum();
            saver.reserve(bytes)?;
        }
        Ok(start.elapsed())
    }

    /// Whether the step just completed is due for a checkpoint.
    fn due(&self, step: u64) -> bool {
        match &self.planner {
            Some((planner, last)) => planner.is_due(*last, Instant::now()),
            None => self.cfg.every != 0 && step.is_multiple_of(self.cfg.every),
        }
    }

    /// Runs one training step with the checkpoint work around it: stages a save that came due
    /// at the previous step (asynchronous mode) while this step computes, then saves (sync) or
    /// schedules (async) this step if it is due. Returns the step's stats and the save that
    /// finished staging during the call, if any.
    pub fn step(&mut self, trainer: &mut Trainer) -> Result<(StepStats, Option<SaveSummary>)> {
        if !self.prepared {
            self.prepare(trainer)?;
            self.prepared = true;
        }
        let mut summary = None;
        let stats = match self.pending.take() {
            Some((step, meta)) if self.saver.is_some() => {
                let after = self.after_write(meta);
                let (rank, world) = (self.rank, self.world);
                let owners = trainer.expert_owners();
                let saver = self.saver.as_mut().expect("checked above");
                let before = Instant::now();
                saver.wait(SAVE_TIMEOUT)?;
                let previous = before.elapsed();
                let (stats, bytes, waited) = trainer.step_with_staging(|views| {
                    let metas: Vec<TensorMeta> = views.iter().map(|(m, _)| m.clone()).collect();
                    let pieces = share_pieces(views, &owners, rank, world);
                    let pieces = piece_refs(&metas, &pieces);
                    saver
                        .save(step, &pieces, after)
                        .map(|_| piece_bytes(&pieces))
                })?;
                summary = Some(self.record(step, bytes?, previous + waited)?);
                stats
            }
            _ => trainer.step()?,
        };
        if self.due(stats.step) {
            // A ZeRO rank's step writes the state it would stage (its shards), so its save
            // copies them in the foreground; the write still runs in the background.
            if self.saver.is_some() && trainer.zero_stage().is_none() {
                self.pending = Some((stats.step, trainer.checkpoint_meta(&self.run_id)));
            } else {
                summary = Some(self.save(trainer)?);
            }
        }
        Ok((stats, summary))
    }

    /// Notes a finished save: its step, and under the automatic interval its pause.
    fn record(&mut self, step: u64, bytes: u64, pause: Duration) -> Result<SaveSummary> {
        self.last_saved = Some(step);
        let planned = match &mut self.planner {
            Some((planner, last)) => {
                planner
                    .record_pause(pause.as_secs_f64())
                    .map_err(ckpt::CkptError::from)?;
                *last = Instant::now();
                Some((planner.interval(), planner.expected_loss_fraction()))
            }
            None => None,
        };
        Ok(SaveSummary {
            step,
            bytes,
            pause,
            planned,
        })
    }

    /// Saves the current step now, staging in the foreground (waiting first for an earlier
    /// asynchronous save, whose time counts in this pause).
    pub fn save(&mut self, trainer: &mut Trainer) -> Result<SaveSummary> {
        let started = Instant::now();
        let step = trainer.steps_done();
        let meta = match self.pending.take() {
            Some((pending, meta)) if pending == step => meta,
            _ => trainer.checkpoint_meta(&self.run_id),
        };
        let after = self.after_write(meta);
        let metas = state_metas(trainer.model().layout());
        let pieces = trainer.checkpoint_pieces(self.rank, self.world);
        let pieces = piece_refs(&metas, &pieces);
        self.write(step, &pieces, after)?;
        let bytes = piece_bytes(&pieces);
        self.record(step, bytes, started.elapsed())
    }

    /// Saves `step` from the pieces an engine built itself: a model-parallel or expert engine's
    /// pieces of the checkpoint `meta` describes (`meta.world_size` its writers, this
    /// checkpointer's `world`). Asynchronous saves copy the pieces into the host buffer and
    /// write in the background; the training pause is the caller's gathering plus this copy.
    pub fn save_pieces(
        &mut self,
        step: u64,
        meta: CheckpointMeta,
        pieces: &[(&TensorMeta, &Slice, &[u8])],
    ) -> Result<SaveSummary> {
        let started = Instant::now();
        let after = self.commit_after(meta);
        self.write(step, pieces, after)?;
        self.record(step, piece_bytes(pieces), started.elapsed())
    }

    /// Writes this rank's `pieces` of `step`, in the background when asynchronous (after the
    /// save in flight, if any), then `after` commits or hands over.
    fn write(
        &mut self,
        step: u64,
        pieces: &[(&TensorMeta, &Slice, &[u8])],
        after: ckpt::AfterWrite,
    ) -> Result<()> {
        match &mut self.saver {
            Some(saver) => {
                saver.wait(SAVE_TIMEOUT)?;
                saver.save(step, pieces, after)?;
            }
            None => {
                let written = RankWriter::write_all(&self.cfg.dir, step, self.rank, pieces)?;
                after(step, written)?;
            }
        }
        Ok(())
    }

    /// The step saved last by this checkpointer, if any.
    pub fn last_saved(&self) -> Option<u64> {
        self.last_saved
    }

    /// Waits for the asynchronous save in flight, if any, to be written and committed.
    pub fn wait(&mut self) -> Result<()> {
        if let Some(saver) = &mut self.saver {
            saver.wait(SAVE_TIMEOUT)?;
        }
        Ok(())
    }

    /// At the end of a run: saves the final step unless it was already saved (or is already
    /// committed, as when a run resumes at its last step), and waits for the save in flight.
    pub fn finish(&mut self, trainer: &mut Trainer) -> Result<Option<SaveSummary>> {
        let step = trainer.steps_done();
        let committed = ckpt::list_committed(&self.cfg.dir)?.contains(&step);
        let summary = if self.last_saved != Some(step) && !committed {
            Some(self.save(trainer)?)
        } else {
            None
        };
        self.wait()?;
        Ok(summary)
    }
}

/// Rank `rank` of `world`'s [`ckpt::rank_rows`] of the tensor `m` whose whole bytes are
/// `bytes`, with the bytes of those rows (None: it owns no rows).
pub(crate) fn row_piece<'a>(
    m: &TensorMeta,
    bytes: &'a [u8],
    rank: u32,
    world: u32,
) -> Option<(Slice, &'a [u8])> {
    let s = ckpt::rank_rows(&m.shape, rank, world)?;
    let bytes = match (m.shape.first(), s.0.first()) {
        (Some(&rows), Some(first)) => {
            let row_bytes = bytes.len() / rows as usize;
            let at = first.offset as usize * row_bytes;
            &bytes[at..at + first.len as usize * row_bytes]
        }
        _ => bytes,
    };
    Some((s, bytes))
}

/// `pieces` as the writer takes them, each with its tensor from `metas`.
pub(crate) fn piece_refs<'a>(
    metas: &'a [TensorMeta],
    pieces: &'a [StatePiece<'a>],
) -> Vec<(&'a TensorMeta, &'a Slice, &'a [u8])> {
    pieces.iter().map(|(i, s, b)| (&metas[*i], s, *b)).collect()
}

/// Bytes of tensor data in `pieces`.
fn piece_bytes(pieces: &[(&TensorMeta, &Slice, &[u8])]) -> u64 {
    pieces.iter().map(|(_, _, b)| b.len() as u64).sum()
}
