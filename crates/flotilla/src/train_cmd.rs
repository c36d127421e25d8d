//! `flotilla train`: train a model in this process, printing step, loss,
//! tokens/s and MFU.
use crate::model_args::{ModelArgs, TrainArgs};
use crate::spawn::{NodePlan, NodeSpec, Supervision, Worker, agent_config};
use crate::train_ckpt::{open_checkpoints, saved_line, slowest_rank};
use crate::train_lines::{comm_note, say, split_note, state_line};
use anyhow::{Context, Result, bail};
use comm::group::{GroupConfig, ProcessGroup};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use train::Trainer;
use train::metrics::{gemm_gflops, mfu};

/// Options of `flotilla train`.
#[derive(clap::Args, Debug)]
#[command(args_override_self = true)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    train: TrainArgs,
    #[command(flatten)]
    mesh: crate::train_mesh::MeshArgs,
    /// Data-parallel worker processes on this node: each trains on its --batch rows of every
    /// global batch of nproc x nnodes x batch rows, gradients all-reduced in buckets during the
    /// backward. Default: NPROC_PER_NODE, or Slurm's tasks (or GPUs) per node, else 2. Workers
    /// run under the agent (heartbeats, watchdog, restarts); --nproc 1 on one node without
    /// --chaos trains in this process.
    #[arg(long)]
    nproc: Option<usize>,
    /// Nodes in the job: N, or MIN:MAX for an elastic job (each generation runs on the nodes
    /// still alive, at least MIN; a lost node is dropped at the next restart) (default: NNODES
    /// or SLURM_NNODES, else 1).
    #[arg(long)]
    nnodes: Option<launch::NodeRange>,
    /// This node's index (default: NODE_RANK or SLURM_NODEID, else 0).
    #[arg(long)]
    node_rank: Option<usize>,
    /// The rendezvous store, HOST:PORT, hosted by node 0 (default: MASTER_ADDR:MASTER_PORT or
    /// the first host of SLURM_JOB_NODELIST; one node: a free loopback port).
    #[arg(long)]
    rdzv: Option<String>,
    /// Restarts allowed for the whole job: after a worker fails, every worker is stopped and
    /// started again from the last committed checkpoint in --ckpt-dir.
    #[arg(long, default_value_t = 3)]
    max_restarts: u64,
    /// A worker whose heartbeat is silent this long has failed (dead or stopped).
    #[arg(long, default_value_t = 30.0)]
    heartbeat_timeout_s: f64,
    /// A worker whose step does not advance this long has failed (hung inside the loop).
    #[arg(long, default_value_t = 600.0)]
    watchdog_s: f64,
    /// Longest time from a worker's start to its first completed step (joining the group and
    /// resuming included).
    #[arg(long, default_value_t = 600.0)]
    startup_timeout_s: f64,
    /// Deadline for every node's agent to register for a generation (gang admission).
    #[arg(long, default_value_t = 300.0)]
    admission_timeout_s: f64,
    /// Fault injection, generation 0 only: kill@STEP[:RANK], hang@STEP[:RANK] (SIGSTOP),
    /// stall@STEP[:RANK] (no progress, heartbeat alive), corrupt-newest (the newest committed
    /// checkpoint is damaged before the restart); STEP may be `random`. Comma-separated.
    #[arg(long)]
    chaos: Option<String>,
    /// Seed of the chaos plan's random choices (default: from the clock; printed).
    #[arg(long)]
    chaos_seed: Option<u64>,
    /// Gradient bucket size in MiB (data parallel; see train::ddp::DEFAULT_BUCKET_BYTES).
    #[arg(long, default_value_t = 1.0)]
    bucket_mb: f64,
    /// ZeRO stage of a data-parallel run: 0 (every rank keeps the whole state), 1 (optimizer
    /// state sharded), 2 (and gradients), 3 (and parameters, gathered unit by unit).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: u8,
    /// Append per-step metrics and a final summary to this file as JSON lines (lead rank).
    #[arg(long, value_name = "FILE")]
    metrics: Option<PathBuf>,
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
    /// Skip the planner's forecast beside the measured step at the end (a probe of about a
    /// second on every rank).
    #[arg(long)]
    no_plan: bool,
}

/// Run `flotilla train`: in one process, or as the launcher of `--nproc` data-parallel
/// workers (which run this same command with their rank in the environment).
pub fn run(a: Args) -> Result<()> {
    // `flotilla train` alone: the embedded default job (see `EMBEDDED_CKPT_DIR`).
    let embedded = std::env::args_os().count() == 2;
    if a.nproc == Some(0) {
        bail!("--nproc 0: at least one process is needed");
    }
    if !(a.bucket_mb > 0.0 && a.bucket_mb.is_finite()) {
        bail!("--bucket-mb {}: must be a positive number", a.bucket_mb);
    }
    for (flag, v) in [
        ("--heartbeat-timeout-s", a.heartbeat_timeout_s),
        ("--watchdog-s", a.watchdog_s),
        ("--startup-timeout-s", a.startup_timeout_s),
        ("--admission-timeout-s", a.admission_timeout_s),
    ] {
        if !(v > 0.0 && v.is_finite() && v < 1e9) {
            bail!("{flag} {v}: must be a positive number of seconds");
        }
    }
    let chaos = a.chaos.as_deref().map(launch::Chaos::parse).transpose()?;
    if chaos.as_ref().is_some_and(|c| c.corrupt_newest) && a.ckpt_dir.is_none() {
        bail!("--chaos corrupt-newest needs --ckpt-dir (the checkpoints it damages)");
    }
    let mut cfg = a.train.build(a.model.build()?, a.model.vocab.is_some())?;
    match Worker::from_env()? {
        None => {
            let plan = NodePlan::resolve(a.nproc, a.nnodes, a.node_rank, a.rdzv.as_deref())?;
            if a.mesh.splits_model() {
                // Degrees are checked before any worker starts (placement needs the workers).
                a.mesh.shape(plan.nproc * plan.nnodes)?;
                if plan.nproc * plan.nnodes == 1 {
                    bail!("--tp/--pp split the model over workers: run with --nproc 2 or more");
                }
                if a.zero != 0 {
                    bail!(
                        "--zero {} with --tp/--pp: ZeRO is not wired into the mesh engines of the CLI yet",
                        a.zero
                    );
                }
                if a.ckpt_auto_mtbf.is_some() {
                    bail!(
                        "--ckpt-auto-mtbf with --tp/--pp: mesh runs save synchronously on --ckpt-every"
                    );
                }
            }
            if plan.nproc * plan.nnodes > 1 || chaos.is_some() {
                launch(&a, &cfg, &plan, chaos.unwrap_or_default(), embedded)
            } else {
                train(a, cfg, None, Supervision::default())
            }
        }
        Some(w) => {
            if a.train.threads.is_none() {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                cfg.threads = (cores / w.world).max(1);
            }
            let hb = match w.heartbeat {
                Some(period) => Some(
                    launch::Heartbeat::start(&w.rdv, w.rank, period)
                        .with_context(|| format!("starting the heartbeat of rank {}", w.rank))?,
                ),
                None => None,
            };
            let sup = Supervision {
                hb,
                fault: w.chaos.as_deref().map(launch::Fault::parse).transpose()?,
                rank: w.rank,
                generation: w.rdv.generation,
            };
            let group =
                ProcessGroup::new(&w.rdv, "world", w.rank, w.world, GroupConfig::from_env()?)
                    .with_context(|| format!("joining the training group as rank {}", w.rank))?;
            if a.mesh.splits_model() {
                let peak = match a.peak_gflops {
                    Some(p) => p,
                    None => gemm_gflops(&model::Threads::new(cfg.threads)?, 2048, 5),
                };
                let ckpt = a
                    .ckpt_dir
                    .clone()
                    .map(|dir| crate::train_mesh::Checkpoints {
                        dir,
                        every: a.ckpt_every,
                    });
                return crate::train_mesh::train(&a.mesh, cfg, group, sup, peak, a.log_every, ckpt);
            }
            train(a, cfg, Some(group), sup)
        }
    }
}

/// Where `flotilla train` with no arguments keeps its checkpoints (and resumes from them).
const EMBEDDED_CKPT_DIR: &str = "flotilla-run/checkpoints";
/// Checkpoint interval of the embedded default job.
const EMBEDDED_CKPT_EVERY: u64 = 10;

/// Runs this node's workers under the agent (heartbeats, watchdog, restarts from the last
/// checkpoint, chaos) and waits for the job; measures the machine's GEMM peak once for all of
/// them (each rank's MFU denominator is its share).
fn launch(
    a: &Args,
    cfg: &train::TrainConfig,
    plan: &NodePlan,
    chaos: launch::Chaos,
    embedded: bool,
) -> Result<()> {
    use std::time::Duration;
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut ckpt_dir = a.ckpt_dir.clone();
    if embedded {
        let dir = std::path::PathBuf::from(EMBEDDED_CKPT_DIR);
        let resuming = ckpt::list_committed(&dir).is_ok_and(|s| !s.is_empty());
        println!(
            "# embedded default job: {} steps of the {} model on the built-in corpus, {} workers x {} rows; \
             checkpoints every {EMBEDDED_CKPT_EVERY} steps in {EMBEDDED_CKPT_DIR} ({})",
            cfg.steps,
            a.model.config,
            plan.nproc,
            cfg.batch,
            if resuming {
                "found: resuming from the newest; delete the directory to start over"
            } else {
                "none yet: starting at step 0"
            }
        );
        args.extend([
            "--ckpt-dir".into(),
            EMBEDDED_CKPT_DIR.into(),
            "--ckpt-every".into(),
            EMBEDDED_CKPT_EVERY.to_string(),
        ]);
        ckpt_dir = Some(dir);
    }
    if a.peak_gflops.is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let peak = gemm_gflops(&model::Threads::new(cores.max(cfg.threads))?, 2048, 5);
        args.extend([
            "--peak-gflops".into(),
            format!("{}", peak / plan.nproc as f64),
        ]);
    }
    if let Some(source) = plan.source {
        println!(
            "# job: {} node(s) x {} worker(s), this is node {}, store {} (from the {source} environment)",
            plan.nnodes, plan.nproc, plan.node_rank, plan.rdzv
        );
    }
    let spec = NodeSpec {
        nproc: plan.nproc,
        nnodes: plan.nnodes,
        node_rank: plan.node_rank,
        rdzv: plan.rdzv,
        job_timeout: Duration::from_secs(a.job_timeout_s),
    };
    let mut agent = agent_config(&spec, args)?;
    agent.watch = Some(launch::WatchRules {
        heartbeat_timeout: Duration::from_secs_f64(a.heartbeat_timeout_s),
        watchdog: Duration::from_secs_f64(a.watchdog_s),
        startup_timeout: Duration::from_secs_f64(a.startup_timeout_s),
    });
    agent.max_restarts = a.max_restarts;
    agent.chaos = chaos;
    agent.chaos_seed = a.chaos_seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    agent.steps = cfg.steps;
    agent.ckpt_dir = ckpt_dir;
    agent.admission_timeout = Duration::from_secs_f64(a.admission_timeout_s);
    agent.min_nnodes = plan.min_nnodes;
    let report = launch::run(&agent)?;
    if report.restarts > 0 {
        println!(
            "# job finished in generation {} after {} restart(s)",
            report.generation, report.restarts
        );
    }
    Ok(())
}

/// The training run of this process (alone, or one rank of `group`).
fn train(
    a: Args,
    cfg: train::TrainConfig,
    group: Option<ProcessGroup>,
    sup: Supervision,
) -> Result<()> {
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
    let stage = train::zero::Stage::from_number(a.zero)?;
    let mut trainer = match (group, stage) {
        (Some(g), Some(stage)) => Trainer::zero(cfg.clone(), g, stage, bucket_bytes)?,
        (Some(g), None) => Trainer::data_parallel(cfg.clone(), g, bucket_bytes)?,
        (None, Some(stage)) => bail!(
            "--zero {}: ZeRO shards the state over data-parallel ranks; run it with --nproc 2 or more",
            stage.number()
        ),
        (None, None) => Trainer::new(cfg.clone())?,
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
        Some(dir) => Some(open_checkpoints(
            &mut trainer,
            train::CheckpointConfig {
                dir: dir.clone(),
                every: a.ckpt_every,
                asynchronous: !a.ckpt_sync,
                auto_mtbf: a.ckpt_auto_mtbf,
            },
        )?),
        None => None,
    };
    let first = trainer.steps_done();
    sup.resumed(first);
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
    let (mut timed_tokens, mut last_loss) = (0usize, f64::NAN);
    let mut measured = train::forecast::Measured::default();
    // Each timed step's communication wait, split over the ranks at the end (peer_wait).
    let mut waits: Vec<f64> = Vec::new();
    let peak_all = peak * world as f64;
    let mut metrics = match &a.metrics {
        Some(path) if lead => Some(train::metrics_log::MetricsLog::open(
            path,
            train::metrics_log::RunInfo {
                rank: trainer.rank(),
                world,
                generation: sup.generation,
                peak_gflops: peak_all,
                flops_per_token: fpt,
            },
        )?),
        _ => None,
    };
    for _ in first..steps {
        sup.starting();
        let (s, saved) = match &mut checkpointer {
            Some(ck) => ck.step(&mut trainer)?,
            None => (trainer.step()?, None),
        };
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
        let pause = match saved {
            Some(saved) => {
                let saved = slowest_rank(&trainer, saved)?;
                if lead {
                    say(&pb, saved_line(&saved));
                }
                measured.ckpts += 1;
                measured.ckpt_pause_s += saved.pause.as_secs_f64();
                Some(saved.pause)
            }
            None => None,
        };
        if let Some(log) = &mut metrics {
            log.step(&s, pause)?;
        }
        sup.completed(s.step)?;
    }
    sup.finishing();
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
    // The all-gather of every rank's waits is also the final synchronisation: it completes
    // only once every rank has finished training (rank 0's last checkpoint included), so no
    // rank exits before the others.
    let split = match trainer.group() {
        Some(g) => Some(
            train::peer_wait::gather_split(g, &waits)
                .context("final synchronisation (splitting the communication waits)")?,
        ),
        None => None,
    };
    pb.finish_and_clear();
    let tps = timed_tokens as f64 / measured.step_s.max(1e-9);
    if first >= steps {
        let whence = if first > 0 { " (resumed)" } else { "" };
        out!(
            lead,
            "# done: already at step {first} of {steps}{whence}; nothing left to train"
        );
    } else {
        out!(
            lead,
            "# done: {steps} steps, final loss {last_loss:.4}, {tps:.1} tokens/s, MFU {:.1}% (steps after the first){}{}",
            100.0 * mfu(tps, fpt, peak_all),
            comm_note(measured.comm_s, measured.step_s, world),
            split_note(split, measured.step_s)
        );
    }
    if world > 1 {
        out!(lead, "{}", state_line(&trainer));
    }
    if !a.no_plan && measured.steps > 0 {
        let text = crate::train_plan::report(&trainer, &measured)?;
        out!(lead, "{text}");
    }
    if let Some(log) = metrics.take() {
        let path = log.path().display().to_string();
        log.finish()?;
        out!(lead, "# metrics in {path}");
    }
    if a.save.is_some() || a.export_hf.is_some() {
        // ZeRO-3 keeps no whole copy: every rank takes part in gathering one.
        trainer.gather_params()?;
    }
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

fn cfg_dir(a: &Args) -> &std::path::Path {
    a.ckpt_dir.as_deref().unwrap_or(std::path::Path::new("."))
}

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
