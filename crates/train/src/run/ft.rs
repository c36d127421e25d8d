//! The run loop under per-step fault tolerance (`--ft`, [`crate::ft`]): each replica group
//! runs the same steps, its sums across replicas going through the step's quorum; a step
//! whose quorum lost a member is retried by the survivors on the same micro-batches, and a
//! restarted replica receives the state of a live one at the step that admits it.
use std::sync::Arc;
use std::time::Instant;

use comm::group::ProcessGroup;

use super::{Ended, Observer, RunConfig, engine::Engine, outputs, report};
use crate::checkpoint::{Checkpointer, run_id};
use crate::error::{Result, TrainError};
use crate::ft::FaultTolerance;
use crate::metrics::{gemm_gflops, mfu};
use crate::metrics_log::{MetricsLog, RunInfo, StepRecord};
use crate::trainer::Trainer;

/// Why `--ft` cannot run `cfg`, if it cannot: the settings it does not build yet.
pub fn refusal(cfg: &RunConfig) -> Option<String> {
    let l = &cfg.layout;
    let why = if l.splits_model() {
        format!(
            "--tp {} --pp {}: per-step fault tolerance is built for data-parallel replica groups \
             (with ZeRO-1 inside them) so far",
            l.tp, l.pp
        )
    } else if l.ep > 1 {
        "--ep: experts split over replicas cannot survive a replica's loss".into()
    } else if l.zero > 1 {
        format!(
            "--zero {}: under --ft the replica groups shard with ZeRO-1 (--zero 1 --dp-shard N)",
            l.zero
        )
    } else if l.zero == 1 && l.hybrid.0.is_none() && l.hybrid.1.is_none() {
        "--zero 1 without --dp-shard: ZeRO over the whole job cannot lose a replica; shard \
         inside replica groups with --dp-shard N"
            .into()
    } else if cfg.ckpt_remote.is_some() {
        "--ckpt-dir s3://...: the object-store mirror is not built under --ft yet (a local or \
         shared directory works)"
            .into()
    } else if cfg.eval_every > 0 || cfg.trace.is_some() || cfg.export_hf.is_some() {
        "--eval-every, --trace and --export-hf are not built under --ft yet".into()
    } else {
        return None;
    };
    Some(format!("--ft: {why}"))
}

/// Trains `cfg` as one rank of `replica` (its replica group) under the quorum `ft`.
pub fn run(
    cfg: &RunConfig,
    replica: ProcessGroup,
    ft: Arc<FaultTolerance>,
    obs: &mut dyn Observer,
) -> Result<Ended> {
    if let Some(why) = refusal(cfg) {
        return Err(TrainError::Refused(why));
    }
    let steps = cfg.train.steps;
    let peak = match cfg.peak_gflops {
        Some(p) => p,
        None => gemm_gflops(&model::Threads::new(cfg.train.threads)?, 2048, 5),
    };
    let t = Trainer::fault_tolerant(
        cfg.train.clone(),
        replica,
        ft.clone(),
        cfg.layout.bucket_bytes,
    )?;
    let mut engine = Engine::Data(Box::new(t));
    let fpt = engine.flops_per_token(&cfg.train);
    let world = ft.replicas() * ft.replica_size();
    let peak_all = peak * world as f64;
    if ft.is_lead() && !ft.joining() {
        for l in outputs::header(cfg, &engine, fpt, peak) {
            obs.line(&l);
        }
        obs.line(&format!(
            "# ft: {} replica group(s) of {} rank(s); a lost replica is left out and rejoins {} \
             steps after (its rows of those steps are skipped)",
            ft.replicas(),
            world / ft.replicas(),
            ft.join_after()
        ));
    }
    let mut ck = open_checkpoints(cfg, trainer(&mut engine)?, &ft, obs)?;
    obs.resumed(engine.steps_done(), steps);
    let info = RunInfo {
        rank: ft.replica() * ft.replica_size(),
        world,
        generation: cfg.generation,
        peak_gflops: peak_all,
        flops_per_token: fpt,
    };
    // Written by the lead of each step (rank 0 of the first replica present), appended.
    let mut metrics: Option<MetricsLog> = None;
    let (mut timed_tokens, mut timed_s, mut last_loss) = (0usize, 0.0f64, f64::NAN);
    let first_step = Instant::now();
    loop {
        let next = engine.steps_done() + 1;
        if next > steps && !ft.joining() {
            break;
        }
        obs.starting();
        let t = trainer(&mut engine)?;
        let begun = match ft.begin(next) {
            Ok(None) => {
                obs.line(&format!(
                    "# ft: the job finished before replica {} could rejoin",
                    ft.replica()
                ));
                return Ok(Ended::Completed);
            }
            Ok(Some(b)) => Ok(b),
            Err(e) => Err(e),
        };
        let attempt = begun.and_then(|b| {
            if let (Some(root), Some(g)) = (b.transfer_from, ft.group()) {
                let began = Instant::now();
                t.share_state(&g, root)?;
                if b.receiving && t.rank() % ft.replica_size() == 0 {
                    obs.line(&format!(
                        "# ft: replica {} received the state of step {} from a live replica in \
                         {:.1} ms",
                        ft.replica(),
                        t.steps_done(),
                        began.elapsed().as_secs_f64() * 1e3
                    ));
                    obs.resumed(t.steps_done(), steps);
                }
            }
            t.step()
        });
        for l in ft.take_lines() {
            obs.line(&l);
        }
        let s = match attempt {
            Ok(s) => s,
            Err(e @ (TrainError::FaultTolerance(_) | TrainError::Comm(_))) => {
                if matches!(&e, TrainError::FaultTolerance(m) if m.contains("declared down")) {
                    return Err(e);
                }
                ft.retry()?;
                t.retry_step();
                continue;
            }
            Err(e) => return Err(e),
        };
        last_loss = s.loss;
        if s.step > 1 {
            timed_tokens += s.tokens;
            timed_s += s.seconds;
        }
        let lead = ft.is_lead();
        if lead && (s.step % cfg.log_every.max(1) == 0 || s.step == 1 || s.step == steps) {
            obs.line(&report::step_line(&s, steps, fpt, peak_all, world));
        }
        let (attempts, span) = (ft.committed_attempt(), ft.take_lost_seconds());
        let stop = ft.stop_agreed() && s.step < steps;
        // The quorum's first replica saves (its ranks in parallel; its rank 0 commits).
        let saved = match &mut ck {
            Some(c) if ft.saves() && (super::due(c.config(), s.step) || stop) => {
                let t = trainer(&mut engine)?;
                let saved = c.save(t)?;
                if lead {
                    obs.line(&report::saved_line(&saved));
                }
                Some(saved.pause)
            }
            _ => None,
        };
        let record = StepRecord {
            retried: Some(attempts),
            retried_s: Some((span - s.seconds - s.data_seconds).max(0.0)),
            replicas: Some(ft.participants()),
            ..StepRecord::new(&s, &info, saved)
        };
        match (&cfg.metrics, lead) {
            (Some(path), true) => {
                if metrics.is_none() {
                    metrics = Some(MetricsLog::open(path, info)?);
                }
                if let Some(log) = &mut metrics {
                    log.write_step(&record)?;
                }
            }
            _ => metrics = None,
        }
        obs.recorded(&record);
        obs.completed(&s).map_err(TrainError::Observer)?;
        if stop {
            if let Some(c) = &mut ck {
                c.wait()?;
            }
            if lead {
                obs.line(&format!(
                    "# stop requested (SIGTERM): every replica stopped after step {}, saved by \
                     replica {}",
                    s.step,
                    ft.replica()
                ));
            }
            return Ok(Ended::Stopped { step: s.step });
        }
        if ck.is_some() {
            ft.request_stop(obs.stop_requested());
        }
    }
    obs.finishing();
    ft.finish()?;
    let lead = ft.is_lead();
    let mut lines = Vec::new();
    if let Some(c) = &mut ck {
        let t = trainer(&mut engine)?;
        match ft.saves() {
            true => {
                if let Some(saved) = c.finish(t)? {
                    lines.push(report::saved_line(&saved));
                }
                lines.push(format!(
                    "# checkpoints committed in {}",
                    c.config().dir.display()
                ));
            }
            false => c.wait()?,
        }
    }
    let tps = timed_tokens as f64 / timed_s.max(1e-9);
    lines.push(format!(
        "# done: {steps} steps, final loss {last_loss:.4}, {tps:.1} tokens/s, MFU {:.1}% (steps \
         after the first; {:.1} s wall)",
        100.0 * mfu(tps, fpt, peak_all),
        first_step.elapsed().as_secs_f64()
    ));
    if let Some(log) = metrics.take().filter(|_| lead) {
        let path = log.path().display().to_string();
        log.finish()?;
        lines.push(format!("# metrics in {path}"));
    }
    lines.extend(outputs::write_models(cfg, &mut engine, lead)?);
    if lead {
        lines.iter().for_each(|l| obs.line(l));
    }
    Ok(Ended::Completed)
}

/// The data-parallel trainer `engine` was built as.
fn trainer(engine: &mut Engine) -> Result<&mut Trainer> {
    match engine {
        Engine::Data(t) => Ok(t),
        _ => Err(TrainError::FaultTolerance(
            "per-step fault tolerance runs a data-parallel engine".into(),
        )),
    }
}

/// The run's checkpointer under `--ft`: every replica of a first start resumes from the
/// directory (one rank clears its leftovers) and keeps a checkpointer as its replica group's
/// ranks; a restarted replica only keeps one (its state comes from a live replica).
fn open_checkpoints(
    cfg: &RunConfig,
    t: &mut Trainer,
    ft: &FaultTolerance,
    obs: &mut dyn Observer,
) -> Result<Option<Checkpointer>> {
    let Some(c) = &cfg.checkpoint else {
        return Ok(None);
    };
    let size = ft.replica_size();
    let inner = (t.rank() % size) as u32;
    if ft.joining() {
        let ck =
            Checkpointer::new(c.clone(), &run_id(&cfg.train))?.with_shard(inner, size as u32)?;
        return Ok(Some(ck));
    }
    let shard = super::resume::Shard {
        rank: inner,
        world: size as u32,
        clears: t.rank() == 0,
    };
    let opened = super::resume::open_as(t, c.clone(), shard)?;
    if ft.is_lead() {
        let dir = c.dir.display();
        for r in &opened.rejected {
            obs.line(&format!("# checkpoint rejected (lost): {r}"));
        }
        obs.line(&match opened.resumed {
            Some((step, by)) => format!("# resumed from {dir} step {step} (saved by {by} ranks)"),
            None => format!("# no checkpoint in {dir}: starting at step 0"),
        });
    }
    Ok(Some(opened.checkpointer))
}
