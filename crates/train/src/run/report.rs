//! The lines a run reports to the person running it (the command line prints them): the
//! model and the layout, each step, each save, the end of the run with the state each rank
//! holds, and the planner's forecast beside the measurement.
use comm::group::ProcessGroup;

use crate::checkpoint::SaveSummary;
use crate::error::{Context, Result};
use crate::forecast::{self, Measured, UnitTimes, beside, render};
use crate::pipeline::PipelineStage;
use crate::trainer::{StateMemory, StepStats, Trainer};

/// Forecast probe repetitions (the median and the spread are kept).
const PROBE_REPS: usize = 5;

/// The forecast's bar for the whole step.
const STEP_WITHIN: f64 = 0.15;

/// The line of a finished asynchronous-capable save, as the slowest rank saw it.
pub fn saved_line(s: &SaveSummary) -> String {
    let planned = match s.planned {
        Some((tau, loss)) => format!(
            "; next in {tau:.1} s (Young/Daly, expected loss {:.2} %)",
            100.0 * loss
        ),
        None => String::new(),
    };
    format!(
        "# checkpoint step {}: {:.1} MB, training paused {:.1} ms (slowest rank){planned}",
        s.step,
        s.bytes as f64 / 1e6,
        s.pause.as_secs_f64() * 1e3
    )
}

/// The line of one step.
pub fn step_line(s: &StepStats, steps: u64, fpt: f64, peak_all: f64, world: usize) -> String {
    let tps = s.tokens as f64 / s.seconds;
    format!(
        "step {:>6}/{} loss {:.4} lr {:.2e} |g| {:.3} tokens/s {:.0} MFU {:.1}%{}",
        s.step,
        steps,
        s.loss,
        s.lr,
        s.grad_norm,
        tps,
        100.0 * crate::metrics::mfu(tps, fpt, peak_all),
        comm_note(s.comm_seconds, s.seconds, world)
    )
}

/// The line of a validation loss after step `step` of `steps`, over `rows` held-out rows.
pub fn eval_line(step: u64, steps: u64, loss: f64, rows: usize) -> String {
    format!("step {step:>6}/{steps} validation loss {loss:.4} ({rows} held-out rows)")
}

/// The state-memory line of a data-parallel run: what this rank holds, measured, beside the
/// formula of its ZeRO stage (`crate::zero::expected_bytes`).
pub fn state_line(trainer: &Trainer) -> String {
    let m = trainer.state_memory();
    let stage = trainer.zero_stage();
    // Sharded over one replica group under hybrid sharding.
    let shards = trainer
        .zero_engine()
        .map_or(trainer.world(), |z| z.plan().world());
    let (p, g, o) = crate::zero::expected_bytes(stage, shards);
    let n = trainer.model().n_params() as f64;
    format!(
        "# state per rank ({}): parameters {:.1} MB, gradients {:.1} MB, optimizer {:.1} MB \
         (formula {p:.2} + {g:.2} + {o:.2} bytes/param: {:.1} + {:.1} + {:.1} MB){}",
        match (stage, trainer.zero_engine().and_then(|z| z.replicas())) {
            (None, _) => "data parallel".to_string(),
            (Some(s), None) => format!("ZeRO-{}", s.number()),
            (Some(s), Some(r)) => format!(
                "ZeRO-{} hybrid: sharded over {shards}, replicated over {}",
                s.number(),
                r.size()
            ),
        },
        m.params as f64 / 1e6,
        m.grads as f64 / 1e6,
        m.optimizer as f64 / 1e6,
        p * n / 1e6,
        g * n / 1e6,
        o * n / 1e6,
        match m.comm_buffers {
            0 => String::new(),
            b => {
                let kind = if stage.is_some() {
                    "transfer"
                } else {
                    "bucket"
                };
                format!("; {kind} buffers {:.1} MB", b as f64 / 1e6)
            }
        }
    )
}

/// The activation line of a tensor-parallel rank: one layer's activations for one
/// micro-batch, measured from its arena, beside the planner's term for this engine and the
/// published formula (Korthikanti et al., without the attention scores this engine's flash
/// attention does not keep, at 4-byte elements).
pub fn activation_line(trainer: &Trainer) -> String {
    let c = trainer.config();
    let m = &c.model;
    let (tp, sp) = (
        trainer.tp(),
        trainer.tensor_part().is_some_and(|t| t.sequence),
    );
    let shape = plan::engine_memory::BlockShape {
        h: m.d_model,
        heads: m.heads,
        kv_heads: m.kv_heads,
        ffn: m.ffn,
        gated: m.activation == model::config::Activation::SwiGlu,
    };
    let rows = (c.seq_len, c.batch);
    let planned = plan::engine_memory::engine_activation_bytes_per_layer(shape, rows, tp, sp, 4);
    let (s, b) = (c.seq_len as f64, c.batch as f64);
    let (h, a) = (m.d_model as f64, m.heads as f64);
    let published = plan::memory::activation_bytes_per_layer(
        s,
        b,
        h,
        a,
        tp as f64,
        sp,
        plan::layout::Recompute::Selective,
        2.0,
    );
    format!(
        "# activations per layer and micro-batch (tp {tp}, sequence parallel {}): {:.3} MB \
         measured; planner {:.3} MB for this engine, published formula {:.3} MB",
        if sp { "on" } else { "off" },
        trainer.model().layer_activation_bytes() as f64 / 1e6,
        planned / 1e6,
        published / 1e6
    )
}

/// The state-memory line of a mesh run: the largest rank's state beside the planner's.
pub fn mesh_state_line(largest: StateMemory, planned: &plan::memory::MemoryBreakdown) -> String {
    let mb = |b: f64| b / 1e6;
    format!(
        "# state per rank (largest): params {:.2} MB, grads {:.2} MB, optimizer {:.2} MB; planner {:.2} / {:.2} / {:.2} MB",
        mb(largest.params as f64),
        mb(largest.grads as f64),
        mb(largest.optimizer as f64),
        mb(planned.weights),
        mb(planned.grads),
        mb(planned.optimizer)
    )
}

/// The exposed-communication part of a line, for runs of several ranks.
pub fn comm_note(comm_s: f64, step_s: f64, world: usize) -> String {
    if world == 1 {
        return String::new();
    }
    format!(
        " comm {:.1}% ({world} ranks)",
        100.0 * comm_s / step_s.max(1e-9)
    )
}

/// The summary's split of the lead rank's waits (`crate::peer_wait`): what communication the
/// schedule left exposed, and what was waiting for slower ranks.
pub fn split_note(split: Option<crate::peer_wait::WaitSplit>, step_s: f64) -> String {
    let Some(s) = split else {
        return String::new();
    };
    let pct = |x: f64| 100.0 * x / step_s.max(1e-9);
    format!(
        ": exposed {:.1}% after the slowest rank's compute, {:.1}% waiting for slower ranks",
        pct(s.exposed_s),
        pct(s.peer_wait_s)
    )
}

/// The planner beside the run (issue 7): after the last step every rank probes the model's
/// units at once (so the cores are shared as in training), the ranks' mean is taken, and the
/// forecast of one step is set beside what the run measured. Collective over `world`; every
/// rank gets the report.
pub fn forecast_report(
    trainer: &Trainer,
    world: Option<&ProcessGroup>,
    measured: &Measured,
) -> Result<String> {
    let probe = probe_all(world, trainer.config(), trainer.threads(), trainer.tp())?;
    Ok(beside_report(
        &forecast::forecast(trainer, &probe),
        measured,
    ))
}

/// [`forecast_report`] for a pipeline stage ([`PipelineStage::forecast`]): this stage's
/// view of the step, the lead rank's being stage 0's.
pub fn pipeline_forecast_report(
    stage: &PipelineStage,
    world: Option<&ProcessGroup>,
    measured: &Measured,
) -> Result<String> {
    let th = model::Threads::new(stage.config().threads)?;
    let mut kinds = [false; 3];
    for u in stage.chunk_units().iter().flatten() {
        kinds[forecast::probe::kind(*u)] = true;
    }
    if let Some(g) = world {
        g.barrier()
            .ctx(|| "barrier before the forecast probe".into())?;
    }
    let probe = forecast::probe::measure_kinds(
        stage.config(),
        &th,
        PROBE_REPS,
        stage.tensor_parallel(),
        kinds,
    )
    .ctx(|| "probing the stage's units for the forecast".into())?;
    // Each unit kind's mean over the ranks that run it; the update's over every rank.
    let mut v = probe.to_vec();
    let mut counts = kinds.map(|k| if k { 1.0 } else { 0.0 }).to_vec();
    v.append(&mut counts);
    if let Some(g) = world {
        g.all_reduce(&mut v, comm::ReduceOp::Sum)
            .ctx(|| "gathering the forecast probe".into())?;
    }
    let ranks = world.map_or(1, |g| g.size()) as f64;
    let counts: Vec<f64> = v.split_off(forecast::probe::VALUES);
    // Layout of `to_vec`: fwd, bwd, fwd_sd, bwd_sd (3 kinds each), then the per-param and
    // per-byte costs.
    for (i, x) in v.iter_mut().enumerate() {
        *x /= match i {
            0..12 => counts[i % 3].max(1.0),
            _ => ranks,
        };
    }
    let probe = UnitTimes::from_slice(&v).ok_or_else(|| crate::TrainError::Config {
        field: "forecast probe",
        value: format!("{} values", v.len()),
        reason: "not the probe's length".into(),
    })?;
    Ok(beside_report(&stage.forecast(&probe)?, measured))
}

/// The probe of `cfg`'s units on TP shards of `tp`, taken by every rank of `world` at once and
/// averaged over them.
fn probe_all(
    world: Option<&ProcessGroup>,
    cfg: &crate::TrainConfig,
    th: &model::Threads,
    tp: usize,
) -> Result<UnitTimes> {
    if let Some(g) = world {
        g.barrier()
            .ctx(|| "barrier before the forecast probe".into())?;
    }
    let mut probe = forecast::probe::measure(cfg, th, PROBE_REPS, tp)
        .ctx(|| "probing the model's units for the forecast".into())?;
    if let Some(g) = world {
        // The ranks' mean: their noise is what the forecast's straggler term is made of.
        let mut v = probe.to_vec();
        g.all_reduce(&mut v, comm::ReduceOp::Sum)
            .ctx(|| "gathering the forecast probe".into())?;
        v.iter_mut().for_each(|x| *x /= g.size() as f64);
        probe = UnitTimes::from_slice(&v).ok_or_else(|| crate::TrainError::Config {
            field: "forecast probe",
            value: format!("{} values", v.len()),
            reason: "not the probe's length".into(),
        })?;
    }
    Ok(probe)
}

/// The forecast `f` beside `measured`: the sums behind it, a row per component, the verdict.
fn beside_report(f: &forecast::Forecast, measured: &Measured) -> String {
    let rows = beside(f, measured);
    let mut out = format!(
        "# plan beside measured, per step over {} timed steps (units probed on this machine, all ranks at once):\n",
        measured.steps
    );
    for line in &f.explain {
        out.push_str(&format!("#   = {line}\n"));
    }
    out.push_str(&render(&rows));
    if let Some(step) = rows.iter().find(|r| r.name == "step") {
        out.push_str(&format!(
            "# step forecast {:+.1}% off the measurement: {}",
            100.0 * step.off,
            if step.off.abs() <= STEP_WITHIN {
                "within 15%"
            } else {
                "NOT within 15%"
            }
        ));
    }
    out
}
