//! The one run loop (issue 27): every layout's engine runs under it. It owns the checkpoints
//! (resume with fallback past damaged steps and asynchronous saves for every engine,
//! `--ckpt-sync` for synchronous ones; the automatic Young/Daly interval for a one-process
//! data-parallel run), the metrics (JSON lines),
//! MFU, the planner's forecast beside the measurement, the heartbeats and chaos hooks (through
//! the [`Observer`]), and `--save` / `--export-hf`. The command line maps its arguments to a
//! [`RunConfig`] and prints the lines the loop reports.
//!
//! One step of the loop: the observer hears the step start, the engine steps (with the
//! checkpointer around it when it saves asynchronously), the step is reported and logged, a
//! due checkpoint is saved, and the observer hears the step complete (heartbeat, chaos). With
//! a checkpoint directory the ranks then agree whether any was asked to stop (a pre-emption:
//! [`Observer::stop_requested`]); if so, that step is saved and the run returns
//! [`Ended::Stopped`].
pub mod agreement;
pub mod config;
pub mod engine;
pub mod eval;
pub mod expert;
pub mod ft;
pub mod init;
pub mod mesh;
pub mod mirror;
mod outputs;
pub mod report;
pub mod resume;
mod trace;

use std::time::Instant;

use comm::group::ProcessGroup;

pub use config::{LayoutConfig, RunConfig};
pub use engine::Engine;
pub use expert::{check_moe, moe_line};
pub use init::{HfInit, Init};

use crate::checkpoint::{CheckpointConfig, Checkpointer, SaveSummary, run_id};
use crate::error::{Context, Result};
use crate::forecast::Measured;
use crate::metrics::{gemm_gflops, mfu};
use crate::metrics_log::{MetricsLog, RunInfo, StepRecord};
use crate::trainer::StepStats;
use report::{comm_note, split_note};

/// What the run tells the world around it: lines for the person running the job (the lead
/// rank's), and the step boundaries the launcher's heartbeat and chaos hooks act on.
pub trait Observer {
    /// A line for the person running the job (called on the lead rank only).
    fn line(&mut self, text: &str);
    /// Training starts (again) at `step` of `steps`.
    fn resumed(&mut self, step: u64, steps: u64);
    /// The next step starts.
    fn starting(&mut self);
    /// Step `s` is complete (every rank): progress, heartbeat, then chaos if it is due.
    fn completed(&mut self, s: &StepStats) -> std::result::Result<(), crate::BoxError>;
    /// The loop is over (the final save and synchronisation follow).
    fn finishing(&mut self);
    /// Step `r` is recorded (every rank, after its checkpoint if one was due): the figures
    /// of a live view such as `--metrics-port`.
    fn recorded(&mut self, _r: &StepRecord) {}
    /// Whether this rank was asked to stop (a pre-emption notice: SIGTERM). Asked after every
    /// step of a run with a checkpoint directory: the ranks agree (one asking stops them all
    /// after the same step), that step is saved, and [`run`] returns [`Ended::Stopped`].
    fn stop_requested(&mut self) -> bool {
        false
    }
    /// The ranks named `st` slow (called on the lead rank only, once per straggler): the
    /// launcher's straggler policy acts on it (`--straggler`).
    fn straggler(&mut self, _st: &crate::straggler::Straggler) {}
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Every step trained (or none was left).
    Completed,
    /// Stopped on request after `step`, whose checkpoint is committed: a rerun resumes there.
    Stopped {
        /// The last step trained and saved.
        step: u64,
    },
}

/// How the run saves.
enum Saver {
    /// The data-parallel engine's checkpointer (asynchronous or not, automatic interval).
    Checkpointer(Box<Checkpointer>),
    /// A mesh or expert engine's synchronous saves every `every` steps (0: only at the end),
    /// every rank agreeing on each write before rank 0 commits (`--ckpt-sync`).
    Sync(CheckpointConfig),
    /// A mesh or expert engine's saves every `every` steps through a checkpointer (the
    /// default: asynchronous, the engine's pieces copied into the host buffer and written in
    /// the background).
    Pieces(Box<Checkpointer>),
}

/// Trains `cfg` on this rank of `group` (None: one process), reporting to `obs`.
pub fn run(cfg: &RunConfig, group: Option<ProcessGroup>, obs: &mut dyn Observer) -> Result<Ended> {
    let (rank, world) = group.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
    let lead = rank == 0;
    let steps = cfg.train.steps;
    // The peak is measured before the engine exists: a data loader starts reading (and
    // hashing shards) at once, which would steal cores from the measurement.
    let peak = match cfg.peak_gflops {
        Some(p) => p,
        None => gemm_gflops(&model::Threads::new(cfg.train.threads)?, 2048, 5),
    };
    let world_group = group.clone();
    let (mut engine, mesh) = Engine::build(cfg, group)?;
    let mut say = |text: String| {
        if lead {
            obs.line(&text)
        }
    };
    let fpt = engine.flops_per_token(&cfg.train);
    outputs::header(cfg, &engine, fpt, peak)
        .into_iter()
        .for_each(&mut say);
    let planned = match (&mesh, &world_group) {
        (Some(m), Some(g)) => {
            let nodes = g.topology().hosts.max(1);
            let (e, lint) =
                mesh::planner_view(&cfg.train, cfg.layout.zero, m.shape, g, nodes, peak)?;
            say(outputs::mesh_line(cfg, m.shape, world, nodes));
            for w in m.mesh.warnings() {
                say(format!("# warning (placement, forced): {w}"));
            }
            for w in &lint {
                say(format!(
                    "# planner warning [{}]: {} ({})",
                    w.code, w.message, w.cite
                ));
            }
            Some(e)
        }
        _ => None,
    };
    // Before the checkpoint directory is opened: a resume replaces these weights.
    if let Some(line) = init::apply(&cfg.init, &cfg.train.model, &mut engine)? {
        say(line);
    }
    let mut mirror = open_mirror(cfg, lead, world_group.as_ref(), &mut say)?;
    let mut saver = open_saver(cfg, &mut engine, world_group.as_ref(), &mut say)?;
    let first = engine.steps_done();
    obs.resumed(first, steps);
    let peak_all = peak * world as f64;
    let info = RunInfo {
        rank,
        world,
        generation: cfg.generation,
        peak_gflops: peak_all,
        flops_per_token: fpt,
    };
    let mut metrics = match &cfg.metrics {
        Some(path) if lead => Some(MetricsLog::open(path, info)?),
        _ => None,
    };
    let mut measured = Measured::default();
    let (mut timed_tokens, mut last_loss) = (0usize, f64::NAN);
    // Each timed step's communication wait, split over the ranks at the end (peer_wait).
    let mut waits: Vec<f64> = Vec::new();
    let mut stopped = None;
    let held_out = eval::HeldOut::of(cfg);
    let mut tracer = (cfg.trace.as_deref())
        .map(|dir| trace::Tracer::start(dir, rank, cfg.generation))
        .transpose()?;
    let mut stragglers = crate::straggler::StragglerWatch::new();
    for _ in first..steps {
        let began = Instant::now();
        obs.starting();
        let (s, saved) = step(&mut engine, saver.as_mut())?;
        last_loss = s.loss;
        // The first step warms caches and the thread pool; it is not timed.
        if s.step > first + 1 || steps == first + 1 {
            timed_tokens += s.tokens;
            measured.steps += 1;
            measured.step_s += s.seconds;
            measured.comm_s += s.comm_seconds;
            measured.data_s += s.data_seconds;
            waits.push(s.comm_seconds);
        }
        if lead && (s.step % cfg.log_every.max(1) == 0 || s.step == 1 || s.step == steps) {
            obs.line(&report::step_line(&s, steps, fpt, peak_all, world));
        }
        let val_loss = match &held_out {
            Some(h) if h.due(s.step, steps) => {
                let (v, rows) = h.loss(&mut engine, &cfg.train, world_group.as_ref())?;
                if lead {
                    obs.line(&report::eval_line(s.step, steps, v, rows));
                }
                Some(v)
            }
            _ => None,
        };
        let saved = match (saved, &mut saver) {
            (Some(saved), _) => Some(outputs::slowest(world_group.as_ref(), saved)?),
            (None, Some(Saver::Sync(c))) if due(c, s.step) => {
                Some(save_sync(&mut engine, c, &cfg.train)?)
            }
            (None, Some(Saver::Pieces(ck))) if due(ck.config(), s.step) => {
                let saved = save_pieces(&mut engine, ck, &cfg.train)?;
                Some(outputs::slowest(world_group.as_ref(), saved)?)
            }
            _ => None,
        };
        if let Some(m) = &mut mirror {
            m.stage_new()?;
        }
        if let Some((saved, line)) = &saved {
            if lead {
                obs.line(line);
            }
            measured.ckpts += 1;
            measured.ckpt_pause_s += saved.pause.as_secs_f64();
        }
        let record = StepRecord {
            val_loss,
            ..StepRecord::new(&s, &info, saved.as_ref().map(|(s, _)| s.pause))
        };
        if let Some(log) = &mut metrics {
            log.write_step(&record)?;
        }
        obs.recorded(&record);
        if let Some(t) = &mut tracer {
            t.step(&s, began, saved.as_ref().map(|(s, _)| s.pause))?;
        }
        obs.completed(&s).map_err(crate::TrainError::Observer)?;
        if let Some(st) = stragglers.step(world_group.as_ref(), &s)? {
            crate::straggler::record(&st, world_group.as_ref(), metrics.as_mut())?;
            if lead {
                obs.line(&st.line());
                obs.straggler(&st);
            }
        }
        // After the last step the run ends as usual (its final save and outputs follow).
        if cfg.checkpoint.is_some()
            && s.step < steps
            && stop_agreed(world_group.as_ref(), obs.stop_requested())?
        {
            if lead {
                obs.line(&format!(
                    "# stop requested (SIGTERM): stopping after step {}, saving it",
                    s.step
                ));
            }
            stopped = Some(s.step);
            break;
        }
    }
    obs.finishing();
    if let Some(path) = tracer.take().map(trace::Tracer::finish).transpose()?
        && lead
    {
        obs.line(&format!(
            "# trace of rank 0 in {} (one file per rank)",
            path.display()
        ));
    }
    let finished = finish_saves(
        &mut engine,
        saver.as_mut(),
        world_group.as_ref(),
        first < steps,
        &cfg.train,
    )?;
    if lead {
        finished.iter().for_each(|l| obs.line(l));
    }
    if let Some(step) = stopped {
        // Every rank's pieces are written and rank 0 has committed before any rank exits.
        if let Some(g) = &world_group {
            g.barrier()
                .ctx(|| "the barrier after the stop's checkpoint".into())?;
        }
        if let Some(line) = mirror.map(mirror::Mirror::finish).transpose()?.flatten() {
            obs.line(&line);
        }
        return Ok(Ended::Stopped { step });
    }
    // The all-gather of every rank's waits is also the final synchronisation: it completes
    // only once every rank has finished training (rank 0's last checkpoint included), so no
    // rank exits before the others.
    let split = match &world_group {
        Some(g) => Some(
            crate::peer_wait::gather_split(g, &waits)
                .ctx(|| "final synchronisation (splitting the communication waits)".into())?,
        ),
        None => None,
    };
    let tps = timed_tokens as f64 / measured.step_s.max(1e-9);
    let mut lines = vec![];
    lines.extend(mirror.map(mirror::Mirror::finish).transpose()?.flatten());
    if first >= steps {
        let whence = if first > 0 { " (resumed)" } else { "" };
        lines.push(format!(
            "# done: already at step {first} of {steps}{whence}; nothing left to train"
        ));
    } else {
        lines.push(format!(
            "# done: {steps} steps, final loss {last_loss:.4}, {tps:.1} tokens/s, MFU {:.1}% (steps after the first){}{}{}",
            100.0 * mfu(tps, fpt, peak_all),
            comm_note(measured.comm_s, measured.step_s, world),
            split_note(split, measured.step_s),
            planned
                .as_ref()
                .map_or(String::new(), |e| format!("; planner {:.1} tokens/s", e.tokens_per_s))
        ));
    }
    lines.extend(outputs::state_lines(
        &engine,
        world_group.as_ref(),
        planned.as_ref(),
        &measured,
    )?);
    lines.extend(moe_line(cfg, &engine));
    if cfg.forecast && measured.steps > 0 {
        let world = world_group.as_ref();
        // A forecast that cannot be made is said, not fatal: the run itself is done.
        let made = match &engine {
            Engine::Data(t) | Engine::Tensor(t) => {
                Some(report::forecast_report(t, world, &measured))
            }
            Engine::Pipeline(p) => Some(report::pipeline_forecast_report(p, world, &measured)),
        };
        match made {
            Some(Ok(line)) => lines.push(line),
            Some(Err(e)) => lines.push(format!("# forecast not made: {e}")),
            None => {}
        }
    }
    if let Some(log) = metrics.take() {
        let path = log.path().display().to_string();
        log.finish()?;
        lines.push(format!("# metrics in {path}"));
    }
    if let Some(m) = engine.data_metrics() {
        lines.push(format!(
            "# data: stall {:.2} % of step time (eq. 4.2), batch build P50 {:.3} ms P99 {:.3} ms, \
             prefetch depth {}, {} batches",
            m.stall_pct(),
            m.p50_latency.as_secs_f64() * 1e3,
            m.p99_latency.as_secs_f64() * 1e3,
            m.depth,
            m.batches
        ));
    }
    lines.extend(outputs::write_models(cfg, &mut engine, lead)?);
    if lead {
        lines.iter().for_each(|l| obs.line(l));
    }
    Ok(Ended::Completed)
}

/// Whether any rank asked to stop (`mine`: this one): the maximum over the ranks, so every
/// rank stops after the same step.
fn stop_agreed(world: Option<&ProcessGroup>, mine: bool) -> Result<bool> {
    let mut v = [if mine { 1.0 } else { 0.0 }];
    if let Some(g) = world {
        g.all_reduce(&mut v, comm::ReduceOp::Max)
            .ctx(|| "agreeing on a stop request".into())?;
    }
    Ok(v[0] > 0.0)
}

/// The lead rank's mirror of a checkpoint directory in object storage (fetching a newer
/// remote step first); every rank then waits for it before anything is resumed.
fn open_mirror(
    cfg: &RunConfig,
    lead: bool,
    world: Option<&ProcessGroup>,
    say: &mut impl FnMut(String),
) -> Result<Option<mirror::Mirror>> {
    let (Some(url), Some(c)) = (&cfg.ckpt_remote, &cfg.checkpoint) else {
        return Ok(None);
    };
    let opened = if lead {
        let (m, line) = mirror::Mirror::open(url, &c.dir)?;
        line.into_iter().for_each(&mut *say);
        Some(m)
    } else {
        None
    };
    if let Some(g) = world {
        g.barrier()
            .ctx(|| format!("waiting for the lead rank to fetch {url}"))?;
    }
    Ok(opened)
}

/// Opens the run's checkpoint directory, resuming from it; reports what it found.
fn open_saver(
    cfg: &RunConfig,
    engine: &mut Engine,
    world: Option<&ProcessGroup>,
    say: &mut dyn FnMut(String),
) -> Result<Option<Saver>> {
    let Some(c) = &cfg.checkpoint else {
        return Ok(None);
    };
    let dir = c.dir.display();
    match engine {
        Engine::Data(t) => {
            let opened = resume::open(t, c.clone())?;
            for r in &opened.rejected {
                say(format!("# checkpoint rejected (lost): {r}"));
            }
            match opened.resumed {
                Some((step, saved_by)) => {
                    let world = t.world() as u32;
                    let elastic = match saved_by {
                        w if w != world && w > 0 => {
                            format!(" (saved by {w} ranks, continuing on {world}: elastic)")
                        }
                        _ => String::new(),
                    };
                    say(format!("# resumed from {dir} step {step}{elastic}"));
                }
                None => say(format!("# no checkpoint in {dir}: starting at step 0")),
            }
            if let Some(mapped) = opened.mapped {
                say(format!(
                    "# checkpoint host buffer mapped in {:.1} ms (asynchronous saves copy into it)",
                    mapped.as_secs_f64() * 1e3
                ));
            }
            Ok(Some(Saver::Checkpointer(Box::new(opened.checkpointer))))
        }
        sync => {
            match sync
                .resume_sync(&c.dir, world)
                .ctx(|| "resuming the run".into())?
            {
                Some((step, rejected)) => {
                    for r in &rejected {
                        say(format!("# checkpoint rejected (lost): {r}"));
                    }
                    say(format!("# resumed from {dir} step {step}"));
                }
                None => say(format!("# no checkpoint in {dir}: starting at step 0")),
            }
            if !c.asynchronous {
                return Ok(Some(Saver::Sync(c.clone())));
            }
            let (rank, size) = world.map_or((0, 1), |g| (g.rank() as u32, g.size() as u32));
            let ck = Checkpointer::new(c.clone(), &run_id(&cfg.train))?.with_shard(rank, size)?;
            Ok(Some(Saver::Pieces(Box::new(ck))))
        }
    }
}

/// Whether `step` is due for a save every `c.every` steps.
pub(crate) fn due(c: &CheckpointConfig, step: u64) -> bool {
    c.every > 0 && step.is_multiple_of(c.every)
}

/// A mesh or expert engine's save of its current step through `ck` (asynchronous unless
/// `--ckpt-sync`).
fn save_pieces(
    engine: &mut Engine,
    ck: &mut Checkpointer,
    train: &crate::TrainConfig,
) -> Result<SaveSummary> {
    engine
        .save_into(ck, &run_id(train))
        .ctx(|| "saving a checkpoint".into())
}

/// One step of `engine`, with the checkpointer around it when it has one; the save that
/// finished during the step, if any.
fn step(
    engine: &mut Engine,
    saver: Option<&mut Saver>,
) -> Result<(StepStats, Option<SaveSummary>)> {
    match (engine, saver) {
        (Engine::Data(t), Some(Saver::Checkpointer(ck))) => ck.step(t),
        (engine, _) => Ok((engine.step()?, None)),
    }
}

/// A mesh or expert engine's synchronous save of its current step, and its line.
fn save_sync(
    engine: &mut Engine,
    c: &CheckpointConfig,
    train: &crate::TrainConfig,
) -> Result<(SaveSummary, String)> {
    let t = Instant::now();
    let step = engine
        .save_sync(&c.dir, &run_id(train))
        .ctx(|| "saving a checkpoint".into())?;
    let pause = t.elapsed();
    let line = format!(
        "# checkpoint: step {step} committed in {} ({:.1} ms, synchronous)",
        c.dir.display(),
        pause.as_secs_f64() * 1e3
    );
    let summary = SaveSummary {
        step,
        bytes: 0,
        pause,
        planned: None,
    };
    Ok((summary, line))
}

/// The end of the run's saves: the last step unless it was just saved (or nothing was
/// trained), and the wait for a save in flight; the lines to report.
fn finish_saves(
    engine: &mut Engine,
    saver: Option<&mut Saver>,
    world: Option<&ProcessGroup>,
    trained: bool,
    train: &crate::TrainConfig,
) -> Result<Vec<String>> {
    let mut lines = vec![];
    match (engine, saver) {
        (Engine::Data(t), Some(Saver::Checkpointer(ck))) => {
            if let Some(saved) = ck.finish(t)? {
                let saved = resume::slowest_rank(world, saved)?;
                lines.push(report::saved_line(&saved));
            }
            lines.push(format!(
                "# checkpoints committed in {}",
                ck.config().dir.display()
            ));
        }
        (engine, Some(Saver::Sync(c)))
            if trained && (c.every == 0 || !engine.steps_done().is_multiple_of(c.every)) =>
        {
            lines.push(save_sync(engine, c, train)?.1);
        }
        (engine, Some(Saver::Pieces(ck))) => {
            let step = engine.steps_done();
            if trained && ck.last_saved() != Some(step) {
                let saved = save_pieces(engine, ck, train)?;
                lines.push(outputs::slowest(world, saved)?.1);
            }
            ck.wait()?;
            lines.push(format!(
                "# checkpoints committed in {}",
                ck.config().dir.display()
            ));
        }
        _ => {}
    }
    Ok(lines)
}
