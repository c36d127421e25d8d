//! `flotilla bench model`: training throughput in the peer benchmark's
//! format (`../shared/peers/ddp_gpt_bench.py`, mode single), and the GEMM
//! kernel's rate at 1024^3 and 2048^3.
use crate::flag_range::{positive_usize, usize_in};
use crate::model_args::{ModelArgs, TrainArgs};
use anyhow::{Result, bail};
use serde_json::json;
use train::Trainer;
use train::metrics::{Throughput, gemm_gflops};

/// Largest square GEMM `--gemm` measures: 16384 (three f32 matrices of 1 GiB each).
const MAX_GEMM: u64 = 1 << 14;

/// Options of `flotilla bench model`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    train: TrainArgs,
    /// Untimed steps before the timed ones.
    #[arg(long = "untimed", default_value_t = 3)]
    untimed: u64,
    /// GEMM sizes to measure (square).
    #[arg(long, value_delimiter = ',', default_value = "1024,2048", value_parser = usize_in(1, MAX_GEMM))]
    gemm: Vec<usize>,
    /// GEMM repetitions (median reported).
    #[arg(long, default_value_t = 20, value_parser = positive_usize())]
    gemm_reps: usize,
    /// Print where the timed steps' time went, per kernel.
    #[arg(long)]
    profile: bool,
    /// One JSON object (the setup, GEMM rates, the timed steps' figures and the profile)
    /// instead of lines.
    #[arg(long)]
    json: bool,
}

/// Run `flotilla bench model`.
pub fn run(a: Args) -> Result<()> {
    if a.train.steps == 0 {
        bail!("--steps 0: the benchmark needs at least one timed step");
    }
    let mut targs = a.train.clone();
    targs.steps += a.untimed;
    let cfg = targs.build(a.model.build()?, a.model.vocab.is_some(), None)?;
    let mut trainer = Trainer::new(cfg.clone())?;
    let th = trainer.threads();
    let mut peaks = Vec::new();
    for &n in &a.gemm {
        peaks.push((n, gemm_gflops(th, n, a.gemm_reps)));
    }
    let peak = peaks
        .iter()
        .find(|(n, _)| *n == 2048)
        .map(|p| p.1)
        .unwrap_or_else(|| gemm_gflops(th, 2048, 5));
    let fpt = trainer.flops_per_token();
    if !a.json {
        println!(
            "# flotilla model bench config={} layers={} heads={} d_model={} seq_len={} vocab={} batch={} threads={}",
            a.model.config,
            cfg.model.layers,
            cfg.model.heads,
            cfg.model.d_model,
            cfg.seq_len,
            cfg.model.vocab,
            cfg.batch,
            cfg.threads
        );
        println!(
            "# params {:.2}M, flops/token {:.1} MFLOP",
            trainer.model().n_params() as f64 / 1e6,
            fpt / 1e6
        );
        for (n, g) in &peaks {
            println!("# gemm {n}^3 f32: {g:.1} GFLOP/s ({} threads)", cfg.threads);
        }
    }
    let (first, last, times) = timed_steps(&mut trainer, &a)?;
    let tp = Throughput::of_steps(&times, cfg.tokens_per_step(), fpt, peak);
    let profile = a.profile.then(model::profile::take);
    if a.json {
        let gemm: Vec<_> = peaks
            .iter()
            .map(|(n, g)| json!({"n": n, "gflops": g}))
            .collect();
        let row = |(k, s, c)| json!({"kernel": k, "seconds": s, "calls": c});
        let profile = profile.map(|rows| rows.into_iter().map(row).collect::<Vec<_>>());
        let m = &cfg.model;
        let v = json!({"config": a.model.config, "layers": m.layers, "heads": m.heads,
            "d_model": m.d_model, "seq_len": cfg.seq_len, "vocab": m.vocab, "batch": cfg.batch,
            "threads": cfg.threads, "params": trainer.model().n_params(), "flops_per_token": fpt,
            "gemm": gemm, "throughput": tp, "loss_first": first, "loss_last": last,
            "profile": profile});
        println!("{v}");
        return Ok(());
    }
    println!(
        "{:<6} {:<14} {:>5} {:>8} {:>10} {:>10} {:>9} {:>9} {:>8} {:>6} {:>12}",
        "config",
        "mode",
        "procs",
        "thr/proc",
        "glob_batch",
        "tokens/s",
        "step_ms",
        "median_ms",
        "GFLOP/s",
        "MFU",
        "loss"
    );
    println!(
        "{:<6} {:<14} {:>5} {:>8} {:>10} {:>10.1} {:>9.1} {:>9.1} {:>8.1} {:>5.1}% {:>5.2}->{:<5.2}",
        a.model.config,
        "single",
        1,
        cfg.threads,
        cfg.batch,
        tp.tokens_per_s,
        tp.step_ms,
        tp.median_ms,
        tp.gflops,
        100.0 * tp.mfu,
        first,
        last
    );
    if let Some(rows) = profile {
        print_profile(rows, times.iter().sum(), times.len());
    }
    Ok(())
}

/// Runs the untimed steps, then the timed ones (profiled with `--profile`); returns the loss
/// of the last untimed step, of the last timed step and the timed steps' seconds.
fn timed_steps(trainer: &mut Trainer, a: &Args) -> Result<(f64, f64, Vec<f64>)> {
    let mut first = f64::NAN;
    for _ in 0..a.untimed {
        first = trainer.step()?.loss;
    }
    model::profile::take();
    model::profile::enable(a.profile);
    let mut times = Vec::new();
    let mut last = f64::NAN;
    for _ in 0..a.train.steps {
        let s = trainer.step()?;
        times.push(s.seconds);
        last = s.loss;
    }
    Ok((first, last, times))
}

/// The per-kernel table of the timed steps.
fn print_profile(rows: Vec<(&str, f64, u64)>, wall: f64, steps: usize) {
    let covered: f64 = rows.iter().map(|r| r.1).sum();
    println!(
        "# where a step's {:.1} ms went (per step; {:.1}% of wall covered):",
        wall / steps as f64 * 1e3,
        100.0 * covered / wall
    );
    for (name, secs, calls) in rows {
        println!(
            "#   {name:<20} {:>8.2} ms {:>5.1}%  {:>4} calls",
            secs / steps as f64 * 1e3,
            100.0 * secs / wall,
            calls / steps as u64
        );
    }
}
