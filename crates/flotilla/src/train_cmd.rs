//! `flotilla train`: train a model in this process, printing step, loss,
//! tokens/s and MFU.
use crate::model_args::{ModelArgs, TrainArgs};
use crate::spawn::{NodeSpec, Worker, run_node};
use anyhow::{Context, Result, bail};
use comm::group::{GroupConfig, ProcessGroup};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use train::Trainer;
use train::metrics::{gemm_gflops, mfu};

/// Options of `flotilla train`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    train: TrainArgs,
    /// Data-parallel worker processes on this machine: each trains on its --batch rows of every
    /// global batch of nproc x batch rows, gradients all-reduced in buckets during the backward.
    #[arg(long, default_value_t = 1)]
    nproc: usize,
    /// Gradient bucket size in MiB (data parallel; see train::ddp::DEFAULT_BUCKET_BYTES).
    #[arg(long, default_value_t = 1.0)]
    bucket_mb: f64,
    /// Stop the whole job (every worker) if it runs longer than this.
    #[arg(long, default_value_t = 24 * 3600)]
    job_timeout_s: u64,
    /// Print a line every this many steps.
    #[arg(long, default_value_t = 10)]
    log_every: u64,
    /// Save the trained model (Flotilla names, config in the metadata) to this directory.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Also export it in Hugging Face layout (model.safetensors + config.json) to this directory.
    #[arg(long)]
    export_hf: Option<PathBuf>,
    /// Directory of the run's distributed checkpoints. The run saves there and, when it already
    /// holds a committed step, first resumes from the newest one that loads (falling back past
    /// any that fail verification, and saying so).
    #[arg(long)]
    ckpt_dir: Option<PathBuf>,
    /// Save a checkpoint every this many steps (0: only at the end of the run).
    #[arg(long, default_value_t = 0, requires = "ckpt_dir")]
    ckpt_every: u64,
    /// Save synchronously (default: asynchronously, the loop pausing only to copy its state).
    #[arg(long, requires = "ckpt_dir")]
    ckpt_sync: bool,
    /// Automatic interval instead of --ckpt-every: the job's mean time between failures in
    /// seconds; saves every sqrt(2 C M) seconds, C being the measured pause (004 eq. 28.24).
    #[arg(
        long,
        value_name = "SECS",
        requires = "ckpt_dir",
        conflicts_with = "ckpt_every"
    )]
    ckpt_auto_mtbf: Option<f64>,
    /// MFU denominator in GFLOP/s (default: measure this machine's 2048^3 GEMM).
    #[arg(long)]
    peak_gflops: Option<f64>,
    /// No progress bar (plain lines only).
    #[arg(long)]
    no_progress: bool,
}

/// Run `flotilla train`: in one process, or as the launcher of `--nproc` data-parallel
/// workers (which run this same command with their rank in the environment).
pub fn run(a: Args) -> Result<()> {
    if a.nproc == 0 {
        bail!("--nproc 0: at least one process is needed");
    }
    if !(a.bucket_mb > 0.0 && a.bucket_mb.is_finite()) {
        bail!("--bucket-mb {}: must be a positive number", a.bucket_mb);
    }
    let mut cfg = a.train.build(a.model.build()?, a.model.vocab.is_some())?;
    match Worker::from_env()? {
        None if a.nproc > 1 => launch(&a, &cfg),
        None => train(a, cfg, None),
        Some(w) => {
            if a.train.threads.is_none() {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                cfg.threads = (cores / w.world).max(1);
            }
            let group =
                ProcessGroup::new(&w.rdv, "world", w.rank, w.world, GroupConfig::from_env()?)
                    .with_context(|| format!("joining the training group as rank {}", w.rank))?;
            train(a, cfg, Some(group))
        }
    }
}

/// Starts `--nproc` workers running this command and waits for them; measures the machine's
/// GEMM peak once for all of them (each rank's MFU denominator is its share).
fn launch(a: &Args, cfg: &train::TrainConfig) -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if a.peak_gflops.is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let peak = gemm_gflops(&model::Threads::new(cores.max(cfg.threads))?, 2048, 5);
        args.extend(["--peak-gflops".into(), format!("{}", peak / a.nproc as f64)]);
    }
    let spec = NodeSpec {
        nproc: a.nproc,
        nnodes: 1,
        node_rank: 0,
        rdzv: "127.0.0.1:0".parse().context("loopback address")?,
        job_timeout: std::time::Duration::from_secs(a.job_timeout_s),
    };
    run_node(&spec, &args)
}

/// The training run of this process (alone, or one rank of `group`).
fn train(a: Args, cfg: train::TrainConfig, group: Option<ProcessGroup>) -> Result<()> {
    let lead = group.as_ref().is_none_or(|g| g.rank() == 0);
    let world = group.as_ref().map_or(1, |g| g.size());
    let steps = cfg.steps;
    // The peak is measured before the trainer exists: its data loader starts reading (and
    // hashing shards) at once, which would steal cores from the measurement.
    let peak = match a.peak_gflops {
        Some(p) => p,
        None => gemm_gflops(&model::Threads::new(cfg.threads)?, 2048, 5),
    };
    let bucket_bytes = (a.bucket_mb * (1 << 20) as f64) as usize;
    let mut trainer = match group {
        Some(g) => Trainer::data_parallel(cfg.clone(), g, bucket_bytes)?,
        None => Trainer::new(cfg.clone())?,
    };
    let fpt = trainer.flops_per_token();
    let m = &cfg.model;
    out!(
        lead,
        "# model: {} layers, d_model {}, heads {}/{}, ffn {}, vocab {}, seq_len {}; {:.2}M parameters; {:.1} MFLOP/token",
        m.layers,
        m.d_model,
        m.heads,
        m.kv_heads,
        m.ffn,
        m.vocab,
        cfg.seq_len,
        trainer.model().n_params() as f64 / 1e6,
        fpt / 1e6
    );
    out!(
        lead,
        "# batch {} x {} tokens, {} threads, data {:?}; MFU against {:.1} GFLOP/s ({})",
        cfg.batch,
        cfg.seq_len,
        cfg.threads,
        cfg.data,
        peak,
        if a.peak_gflops.is_some() {
            "given"
        } else {
            "measured 2048^3 GEMM"
        }
    );
    if let Some(h) = trainer.entropy_floor() {
        out!(
            lead,
            "# data entropy rate {h:.4} nats/token (the best achievable loss); uniform {:.4}",
            (m.vocab as f64).ln()
        );
    }
    let mut checkpointer = match &a.ckpt_dir {
        Some(dir) => Some(open_checkpoints(dir, &a, &mut trainer)?),
        None => None,
    };
    let first = trainer.steps_done();
    let pb = if a.no_progress || !lead {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(steps)
    };
    pb.set_position(first);
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
        )
        .context("progress template")?,
    );
    let (mut timed_s, mut timed_tokens, mut last_loss) = (0.0, 0usize, f64::NAN);
    let mut comm_s = 0.0;
    let peak_all = peak * world as f64;
    for _ in first..steps {
        let (s, saved) = match &mut checkpointer {
            Some(ck) => ck.step(&mut trainer)?,
            None => (trainer.step()?, None),
        };
        last_loss = s.loss;
        // The first step warms caches and the thread pool; it is not timed.
        if s.step > first + 1 || steps == first + 1 {
            timed_s += s.seconds;
            timed_tokens += s.tokens;
        }
        comm_s += s.comm_seconds;
        let tps = s.tokens as f64 / s.seconds;
        pb.set_message(format!("loss {:.4} {:.0} tok/s", s.loss, tps));
        pb.inc(1);
        if s.step % a.log_every.max(1) == 0 || s.step == 1 || s.step == steps {
            let line = format!(
                "step {:>6}/{} loss {:.4} lr {:.2e} |g| {:.3} tokens/s {:.0} MFU {:.1}%{}",
                s.step,
                steps,
                s.loss,
                s.lr,
                s.grad_norm,
                tps,
                100.0 * mfu(tps, fpt, peak_all),
                comm_note(s.comm_seconds, s.seconds, world)
            );
            if lead {
                say(&pb, line);
            }
        }
        if let Some(saved) = saved {
            let saved = slowest_rank(&trainer, saved)?;
            if lead {
                say(&pb, saved_line(&saved));
            }
        }
    }
    if let Some(ck) = &mut checkpointer {
        if let Some(saved) = ck.finish(&mut trainer)? {
            let saved = slowest_rank(&trainer, saved)?;
            if lead {
                say(&pb, saved_line(&saved));
            }
        }
        if lead {
            say(
                &pb,
                format!("# checkpoints committed in {}", cfg_dir(&a).display()),
            );
        }
    }
    if let Some(g) = trainer.group() {
        // Every rank finishes together (rank 0's last checkpoint included) before any exits.
        g.barrier().context("final barrier")?;
    }
    pb.finish_and_clear();
    let tps = timed_tokens as f64 / timed_s.max(1e-9);
    out!(
        lead,
        "# done: {steps} steps, final loss {last_loss:.4}, {tps:.1} tokens/s, MFU {:.1}% (steps after the first){}",
        100.0 * mfu(tps, fpt, peak_all),
        comm_note(comm_s, timed_s, world)
    );
    if let Some(m) = trainer.data_metrics() {
        out!(
            lead,
            "# data: stall {:.2} % of step time (eq. 4.2), batch build P50 {:.3} ms P99 {:.3} ms, \
             prefetch depth {}, {} batches",
            m.stall_pct(),
            m.p50_latency.as_secs_f64() * 1e3,
            m.p99_latency.as_secs_f64() * 1e3,
            m.depth,
            m.batches
        );
    }
    if !lead {
        return Ok(());
    }
    if let Some(dir) = &a.save {
        crate::saved::save(dir, &cfg, trainer.model().layout(), trainer.params())?;
        out!(lead, "# saved to {}", dir.display());
    }
    if let Some(dir) = &a.export_hf {
        model::interop::export_hf(dir, &cfg.model, trainer.params())
            .with_context(|| format!("exporting to {}", dir.display()))?;
        write_reference(dir, &cfg, trainer.params())?;
        out!(
            lead,
            "# exported Hugging Face layout to {} (check: python scripts/hf_check.py {})",
            dir.display(),
            dir.display()
        );
    }
    Ok(())
}

/// Prints a line above the progress bar (or plainly when it is hidden).
fn say(pb: &ProgressBar, line: String) {
    if pb.is_hidden() {
        println!("{line}")
    } else {
        pb.println(line)
    }
}

fn saved_line(s: &train::SaveSummary) -> String {
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

fn cfg_dir(a: &Args) -> &std::path::Path {
    a.ckpt_dir.as_deref().unwrap_or(std::path::Path::new("."))
}

/// Opens the checkpoint directory: resumes from its newest loadable step, if any, and returns
/// the checkpointer that saves the rest of the run there.
///
/// Data parallel: rank 0 resumes first (setting aside any step that fails verification), then
/// the others, so all read the same directory state; the ranks then check they resumed the same
/// step. Every rank saves its rows of every tensor in parallel; rank 0 commits.
fn open_checkpoints(
    dir: &std::path::Path,
    a: &Args,
    trainer: &mut Trainer,
) -> Result<train::Checkpointer> {
    let lead = trainer.rank() == 0;
    let resume = |trainer: &mut Trainer| {
        train::Checkpointer::resume(dir, trainer)
            .with_context(|| format!("resuming from {}", dir.display()))
    };
    let resumed = if lead { resume(trainer)? } else { None };
    if let Some(g) = trainer.group() {
        g.barrier().context("resume barrier")?;
    }
    let resumed = if lead { resumed } else { resume(trainer)? };
    if let Some(g) = trainer.group() {
        let step = trainer.steps_done() as f64;
        let (mut lo, mut hi) = ([step], [step]);
        g.all_reduce(&mut lo, comm::ReduceOp::Min)?;
        g.all_reduce(&mut hi, comm::ReduceOp::Max)?;
        if lo != hi {
            bail!(
                "ranks resumed from different steps ({} to {}) of {}",
                lo[0],
                hi[0],
                dir.display()
            );
        }
    }
    match resumed {
        Some((step, rejected)) => {
            for r in &rejected {
                out!(lead, "# checkpoint rejected (lost): {r}");
            }
            out!(lead, "# resumed from {} step {step}", dir.display());
        }
        None => out!(
            lead,
            "# no checkpoint in {}: starting at step 0",
            dir.display()
        ),
    }
    let cfg = train::CheckpointConfig {
        dir: dir.to_path_buf(),
        every: a.ckpt_every,
        asynchronous: !a.ckpt_sync,
        auto_mtbf: a.ckpt_auto_mtbf,
    };
    let run_id = format!("train-seed{}", trainer.config().seed);
    let (rank, world) = (trainer.rank() as u32, trainer.world() as u32);
    let mut ck = train::Checkpointer::new(cfg, &run_id)?.with_shard(rank, world)?;
    let mapped = ck.prepare(trainer)?;
    if !a.ckpt_sync && lead {
        println!(
            "# checkpoint host buffer mapped in {:.1} ms (asynchronous saves copy into it)",
            mapped.as_secs_f64() * 1e3
        );
    }
    Ok(ck)
}

/// A save as the slowest rank saw it: every rank saves at the same step, so the ranks agree
/// here on the longest pause (a small all-reduce).
fn slowest_rank(trainer: &Trainer, mut saved: train::SaveSummary) -> Result<train::SaveSummary> {
    if let Some(g) = trainer.group() {
        let mut v = [saved.pause.as_secs_f64(), saved.bytes as f64];
        g.all_reduce(&mut v[..1], comm::ReduceOp::Max)?;
        g.all_reduce(&mut v[1..], comm::ReduceOp::Sum)?;
        saved.pause = std::time::Duration::from_secs_f64(v[0]);
        saved.bytes = v[1] as u64;
    }
    Ok(saved)
}

/// The exposed-communication part of a line, for data-parallel runs.
fn comm_note(comm_s: f64, step_s: f64, world: usize) -> String {
    if world == 1 {
        return String::new();
    }
    format!(
        " comm {:.1}% ({world} ranks)",
        100.0 * comm_s / step_s.max(1e-9)
    )
}

/// Prints a line only from the lead rank.
macro_rules! out {
    ($lead:expr, $($arg:tt)*) => {
        if $lead {
            println!($($arg)*);
        }
    };
}
use out;

/// Flotilla's logits for one fixed sequence, next to an HF export, so
/// `scripts/hf_check.py` can compare Transformers' logits with ours.
fn write_reference(dir: &std::path::Path, cfg: &train::TrainConfig, params: &[f32]) -> Result<()> {
    let th = model::Threads::new(cfg.threads)?;
    let t = cfg.seq_len;
    let mut m = model::model::Model::<f32>::new(&cfg.model, 1, t, false)?;
    let tokens: Vec<u32> = (0..t)
        .map(|i| ((i * 7919 + 13) % cfg.model.vocab) as u32)
        .collect();
    m.forward(&th, params, &tokens, None)?;
    model::interop::write_reference(dir, 1, &tokens, m.logits())?;
    Ok(())
}
