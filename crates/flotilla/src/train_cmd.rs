//! `flotilla train`: maps the command line to a [`train::run::RunConfig`], then either
//! launches this node's workers under the agent or runs [`train::run::run`] in this process,
//! printing what the run reports beside a progress bar.
use crate::flag_range::{MAX_DEGREE, MAX_NPROC, positive_f64, positive_u64, seconds, usize_in};
use crate::model_args::{ModelArgs, TrainArgs};
use crate::moe_args::MoeArgs;
use crate::spawn::{NodePlan, NodeSpec, Worker, agent_config};
use anyhow::{Context, Result, bail};
use comm::group::{GroupConfig, ProcessGroup};
use indicatif::{ProgressBar, ProgressStyle};
use launch::Supervision;
use launch::http::Live;
use launch::observer::Supervised;
use model::interop::HfDtype;
use std::path::PathBuf;
use train::metrics::gemm_gflops;
use train::pipeline::ScheduleKind;
use train::run::{HfInit, Init, LayoutConfig, RunConfig};

/// Options of `flotilla train`.
#[derive(clap::Args, Debug)]
// A negative number is a value, refused by its flag's range check (not an unknown flag).
#[command(args_override_self = true, allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    train: TrainArgs,
    #[command(flatten)]
    mesh: MeshArgs,
    #[command(flatten)]
    moe: MoeArgs,
    /// Data-parallel worker processes on this node: each trains on its --batch rows of every
    /// global batch of nproc x nnodes x batch rows, gradients all-reduced in buckets during the
    /// backward. Default: NPROC_PER_NODE, or Slurm's tasks (or GPUs) per node, else 2. Workers
    /// run under the agent (heartbeats, watchdog, restarts); --nproc 1 on one node without
    /// --chaos trains in this process.
    #[arg(long, visible_aliases = ["nproc-per-node", "nproc_per_node"], env = "PET_NPROC_PER_NODE", value_parser = usize_in(1, MAX_NPROC))]
    nproc: Option<usize>,
    /// Nodes in the job: N, or MIN:MAX for an elastic job (each generation runs on the nodes
    /// still alive, at least MIN; a lost node is dropped at the next restart) (default: NNODES
    /// or SLURM_NNODES, else 1).
    #[arg(long, env = "PET_NNODES")]
    nnodes: Option<launch::NodeRange>,
    /// This node's index (default: NODE_RANK or SLURM_NODEID, else 0).
    #[arg(long, visible_alias = "node_rank", env = "PET_NODE_RANK")]
    node_rank: Option<usize>,
    /// The rendezvous store, HOST:PORT, hosted by node 0 (default: MASTER_ADDR:MASTER_PORT or
    /// the first host of SLURM_JOB_NODELIST; one node: a free loopback port). A list
    /// HOST0:PORT,HOST1:PORT,... makes node k host the k-th endpoint as a standby: an elastic
    /// job then survives the loss of the store's host (the next live endpoint takes over).
    #[arg(long, visible_aliases = ["rdzv-endpoint", "rdzv_endpoint"], env = "PET_RDZV_ENDPOINT")]
    rdzv: Option<String>,
    /// torchrun's static rendezvous: the store's host, with --master-port (29500 if absent);
    /// the same as --rdzv HOST:PORT.
    #[arg(
        long,
        visible_alias = "master_addr",
        env = "PET_MASTER_ADDR",
        conflicts_with = "rdzv"
    )]
    master_addr: Option<String>,
    /// The store's port with --master-addr.
    #[arg(
        long,
        visible_alias = "master_port",
        env = "PET_MASTER_PORT",
        requires = "master_addr"
    )]
    master_port: Option<u16>,
    /// Each process is one rank that Slurm's srun started (SLURM_PROCID, SLURM_NTASKS,
    /// SLURM_LOCALID; rank 0 hosts the store on the node list's first host at MASTER_PORT or
    /// 29500): no agent, so no heartbeats, watchdog, restarts, chaos or elastic ranges; Slurm's
    /// requeue restarts the job (docs/LAUNCH.md).
    #[arg(long, conflicts_with_all = ["nproc", "nnodes", "node_rank", "rdzv", "master_addr", "chaos", "straggler", "log_dir",
        "max_restarts", "heartbeat_timeout_s", "metrics_port", "watchdog_s", "startup_timeout_s", "admission_timeout_s", "ft"])]
    srun: bool,
    /// Serve the job's live figures for Prometheus on this port (0: a free one, printed):
    /// http://HOST:PORT/metrics in the OpenMetrics text format, names prefixed flotilla_
    /// (docs/OBSERVE.md). Served by node 0's launcher for the whole job, across restarts.
    #[arg(long, value_name = "PORT")]
    metrics_port: Option<u16>,
    /// After SIGTERM (a pre-emption), the time to finish the current step and commit its
    /// checkpoint in --ckpt-dir: the agent then stops any worker still running (SIGKILL), and
    /// the job exits 75 so the scheduler requeues it (docs/LAUNCH.md).
    #[arg(long, default_value_t = 30.0, value_parser = seconds)]
    term_grace_s: f64,
    /// Each worker's stdout and stderr also in DIR/RUN_ID/attempt_GENERATION/LOCAL_RANK/
    /// {stdout,stderr}.log (torchrun's layout).
    #[arg(long, visible_alias = "log_dir", env = "PET_LOG_DIR")]
    log_dir: Option<PathBuf>,
    /// The run's id, naming its folder under --log-dir (torchrun's default: none).
    #[arg(long, visible_aliases = ["rdzv_id", "run-id"], env = "PET_RDZV_ID", default_value = "none", requires = "log_dir")]
    rdzv_id: String,
    /// Restarts allowed for the whole job: after a worker fails, every worker is stopped and
    /// started again from the last committed checkpoint in --ckpt-dir.
    #[arg(
        long,
        visible_alias = "max_restarts",
        env = "PET_MAX_RESTARTS",
        default_value_t = 3
    )]
    max_restarts: u64,
    /// A worker whose heartbeat is silent this long has failed (dead or stopped).
    #[arg(long, default_value_t = 30.0, value_parser = seconds)]
    heartbeat_timeout_s: f64,
    /// A worker whose step does not advance this long has failed (hung inside the loop).
    #[arg(long, default_value_t = 600.0, value_parser = seconds)]
    watchdog_s: f64,
    /// Longest time from a worker's start to its first completed step (joining the group and
    /// resuming included).
    #[arg(long, default_value_t = 600.0, value_parser = seconds)]
    startup_timeout_s: f64,
    /// Deadline for every node's agent to register for a generation (gang admission).
    #[arg(long, default_value_t = 300.0, value_parser = seconds)]
    admission_timeout_s: f64,
    /// Fault injection: kill@STEP[:RANK], hang@STEP[:RANK] (SIGSTOP), stall@STEP[:RANK] (no
    /// progress, heartbeat alive), slow@STEP[:RANK]:FACTOR (fail-slow),
    /// partition@STEP[:NODE[:SECONDS]] (the node's agent and workers cut off the network, then
    /// healed; not node 0), corrupt-newest (the newest committed checkpoint is damaged before
    /// the restart), or soak:N alone (N random faults); STEP may be `random`. Comma-separated;
    /// the g-th failing fault strikes in generation g, a slow@ with the failing fault after it.
    #[arg(long)]
    chaos: Option<String>,
    /// What to do with a rank named slow (its arrival at the step's collectives at least 1.75x
    /// the others' several steps in a row): warn (name it in the log, the metrics and the
    /// flight recorder), or exclude (also drop its node at a generation boundary: elastic jobs,
    /// --nnodes MIN:MAX, only).
    #[arg(long, default_value = "warn")]
    straggler: launch::straggler::Policy,
    /// Seed of the chaos plan's random choices (default: from the clock; printed).
    #[arg(long)]
    chaos_seed: Option<u64>,
    /// Per-step fault tolerance: the data-parallel replica groups (each worker, or --dp-shard
    /// workers sharding with --zero 1) agree on a quorum every step; a failed replica is left
    /// out while the others train on (its rows skipped), and its restart rejoins with a live
    /// replica's state (docs/TRAINING.md). Under --ft every --chaos fault is live at once.
    #[arg(long)]
    ft: bool,
    /// Under --ft: steps after a replica's loss at which its restart rejoins (the survivors
    /// wait there for it if it is not ready, so a fault schedule always gives the same run).
    #[arg(long, default_value_t = 10, requires = "ft", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    ft_join_after: u64,
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
    #[arg(long, default_value_t = 24 * 3600, value_parser = positive_u64())]
    job_timeout_s: u64,
    /// Measure the validation loss on the held-out split every N steps and after the last
    /// (0: never): printed, and `val_loss` in the --metrics lines (docs/OBSERVE.md).
    #[arg(long, value_name = "N", default_value_t = 0)]
    eval_every: u64,
    /// Batches of the held-out split per evaluation (with --eval-every).
    #[arg(long, default_value_t = 4, value_parser = usize_in(1, 1 << 20))]
    eval_batches: usize,
    /// Write a Chrome / Perfetto trace per rank in DIR (rank-R.json: steps, data wait,
    /// compute, each collective, checkpoint copies; docs/OBSERVE.md).
    #[arg(long, value_name = "DIR")]
    trace: Option<PathBuf>,
    /// Print a line every this many steps.
    #[arg(long, default_value_t = 10)]
    log_every: u64,
    /// Save the trained model (Flotilla names, config in the metadata) to this directory.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Also export it in Hugging Face layout (model.safetensors + config.json, and the run's
    /// tokenizer: --init-hf's tokenizer files, or the byte or gpt2 tokenizer as tokenizer.json)
    /// to this directory, loadable with AutoModelForCausalLM and AutoTokenizer.
    #[arg(long)]
    export_hf: Option<PathBuf>,
    /// Dtype of --export-hf's weights: f32 (exact) or bf16 (half the bytes).
    #[arg(long, default_value = "f32", requires = "export_hf")]
    export_dtype: HfDtype,
    /// Fine-tune from a Hugging Face GPT-2 or Llama directory (config.json, and
    /// model.safetensors or its shards' model.safetensors.index.json; f32, bf16 or f16
    /// weights). The model's shape and maximum sequence length come from config.json (--seq-len
    /// may only shorten the training sequences; the shape flags are refused); its
    /// tokenizer.json, when it has one, is the run's tokenizer (a --dataset must be prepared
    /// with it), else --tokenizer. Data parallel, ZeRO and --tp load it; --pp and --experts are
    /// refused. A committed checkpoint in --ckpt-dir wins: the run resumes from it instead.
    #[arg(long, value_name = "DIR",
        conflicts_with_all = ["config", "layers", "d_model", "heads", "kv_heads", "ffn", "vocab", "untied"])]
    init_hf: Option<PathBuf>,
    /// Directory of the run's distributed checkpoints. The run saves there and, when it already
    /// holds a committed step, first resumes from the newest one that loads (falling back past
    /// any that fail verification, and saying so).
    /// s3://bucket/prefix: saved in a local cache ($FLOTILLA_CKPT_CACHE or $TMPDIR), uploaded
    /// in the background, committed remotely last; a newer remote step is fetched before the
    /// resume (`s3` feature).
    #[arg(long)]
    ckpt_dir: Option<PathBuf>,
    /// The object store --ckpt-dir named (it then holds the local cache).
    #[arg(skip)]
    ckpt_remote: Option<String>,
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
        value_parser = positive_f64,
        requires = "ckpt_dir",
        conflicts_with = "ckpt_every"
    )]
    ckpt_auto_mtbf: Option<f64>,
    /// MFU denominator in GFLOP/s (default: measure this machine's 2048^3 GEMM).
    #[arg(long, value_parser = positive_f64)]
    peak_gflops: Option<f64>,
    /// No progress bar (plain lines only).
    #[arg(long)]
    no_progress: bool,
    /// Skip the planner's forecast beside the measured step at the end (a probe of about a
    /// second on every rank).
    #[arg(long)]
    no_plan: bool,
}

/// Mesh options of `flotilla train`.
#[derive(clap::Args, Debug, Clone)]
pub struct MeshArgs {
    /// Tensor-parallel degree: each block's attention and MLP split over T ranks (Megatron
    /// column/row-parallel linears, four all-reduces per block per micro-batch), the
    /// embeddings and head replicated. T must divide the world, heads, kv_heads and ffn.
    #[arg(long, default_value_t = 1, value_parser = usize_in(1, MAX_DEGREE))]
    tp: usize,
    /// Megatron sequence parallelism with --tp: each TP rank keeps 1/T of the rows of the
    /// residual stream, norms and block outputs; an all-gather / reduce-scatter pair replaces
    /// each all-reduce. Needs --tp 2 or more; batch x seq_len must divide by T.
    #[arg(long)]
    sp: bool,
    /// Pipeline stages: the blocks cut into P contiguous stages exchanging activations
    /// point to point; --grad-accum micro-batches per step run under --pipeline-schedule.
    #[arg(long, default_value_t = 1, value_parser = usize_in(1, MAX_DEGREE))]
    pp: usize,
    /// Pipeline schedule: 1f1b, gpipe, or interleaved:V (V chunks per stage).
    #[arg(long, default_value = "1f1b")]
    pipeline_schedule: ScheduleKind,
    /// Run even when a TP group spans hosts (its four all-reduces per block then cross the
    /// slow link); the refusal becomes a warning.
    #[arg(long)]
    force_placement: bool,
    /// Hybrid sharding (HSDP): the --zero state sharded in groups of S consecutive ranks.
    #[arg(long, value_name = "S", value_parser = usize_in(1, MAX_DEGREE))]
    dp_shard: Option<usize>,
    /// Hybrid sharding: R groups replicating the state (S x R = the data-parallel world).
    #[arg(long, value_name = "R", value_parser = usize_in(1, MAX_DEGREE))]
    dp_replicate: Option<usize>,
}

impl Args {
    /// The run configuration these arguments describe (the train config built and checked).
    fn run_config(&self) -> Result<RunConfig> {
        let (train, init) = match &self.init_hf {
            None => {
                let model = self.model.build()?;
                let train = self.train.build(model, self.model.vocab.is_some(), None)?;
                (train, Init::Seed)
            }
            Some(dir) => {
                let hf =
                    HfInit::open(dir).with_context(|| format!("--init-hf {}", dir.display()))?;
                let train = (self.train)
                    .build(hf.model.clone(), true, self.model.seq_len)
                    .with_context(|| format!("--init-hf {}", dir.display()))?;
                hf.check_data(&train.data)?;
                (train, Init::HuggingFace(hf))
            }
        };
        let layout = LayoutConfig {
            tp: self.mesh.tp,
            sp: self.mesh.sp,
            pp: self.mesh.pp,
            schedule: self.mesh.pipeline_schedule,
            zero: self.zero,
            bucket_bytes: (self.bucket_mb * (1 << 20) as f64) as usize,
            force_placement: self.mesh.force_placement,
            hybrid: (self.mesh.dp_shard, self.mesh.dp_replicate),
            ep: 1,
        };
        let mut cfg = RunConfig::new(train, layout);
        // The embedded default job's launcher hands its workers the checkpoint flags.
        cfg.checkpoint = self.ckpt_dir.clone().map(|dir| train::CheckpointConfig {
            dir,
            every: self.ckpt_every,
            asynchronous: !self.ckpt_sync,
            auto_mtbf: self.ckpt_auto_mtbf,
        });
        cfg.metrics = self.metrics.clone();
        cfg.log_every = self.log_every;
        (cfg.eval_every, cfg.eval_batches) = (self.eval_every, self.eval_batches);
        cfg.trace = self.trace.clone();
        cfg.ckpt_remote = self.ckpt_remote.clone();
        cfg.peak_gflops = self.peak_gflops;
        cfg.forecast = !self.no_plan;
        cfg.save = self.save.clone();
        cfg.export_hf = self.export_hf.clone();
        cfg.export_dtype = self.export_dtype;
        cfg.init = init;
        (cfg.train.model.moe, cfg.layout.ep) = self.moe.settings()?;
        Ok(cfg)
    }
}

/// Run `flotilla train`: in one process, or as the launcher of `--nproc` workers (which run
/// this same command with their rank in the environment).
pub fn run(mut a: Args) -> Result<()> {
    if let Some(d) = a.ckpt_dir.take_if(|d| train::run::mirror::is_remote(d)) {
        let url = d.display().to_string();
        a.ckpt_dir = Some(train::run::mirror::cache_dir(&url)?);
        a.ckpt_remote = Some(url);
    }
    // `flotilla train` alone: the embedded default job (see `EMBEDDED_CKPT_DIR`).
    let embedded = std::env::args_os().count() == 2;
    if !(a.bucket_mb > 0.0 && a.bucket_mb.is_finite()) {
        bail!("--bucket-mb {}: must be a positive number", a.bucket_mb);
    }
    let chaos = a.chaos.as_deref().map(launch::Chaos::parse).transpose()?;
    if chaos.as_ref().is_some_and(|c| c.corrupt_newest) && a.ckpt_dir.is_none() {
        bail!("--chaos corrupt-newest needs --ckpt-dir (the checkpoints it damages)");
    }
    let grace = std::time::Duration::from_secs_f64(a.term_grace_s);
    let term = a.ckpt_dir.is_some().then(launch::Termination::install);
    let term = term.transpose()?;
    // Under --srun, rank 0's store lives as long as this function.
    let (srun, _store) = match a.srun.then(launch::SrunRank::from_env).transpose()? {
        Some(r) => (Some(r.worker), r.store),
        None => (None, None),
    };
    match srun.map_or_else(Worker::from_env, |w| Ok(Some(w)))? {
        None => {
            let cfg = a.run_config()?;
            let port = a.master_port.unwrap_or(launch::env::DEFAULT_PORT);
            let master = (a.master_addr.as_ref()).map(|h| format!("{h}:{port}"));
            let rdzv = a.rdzv.clone().or(master);
            let plan = NodePlan::resolve(a.nproc, a.nnodes, a.node_rank, rdzv.as_deref())?;
            cfg.check(plan.nproc * plan.nnodes)?; // before any worker starts
            if a.straggler == launch::straggler::Policy::Exclude && plan.min_nnodes == plan.nnodes {
                bail!(
                    "--straggler exclude drops a slow node from an elastic job: it needs \
                     --nnodes MIN:MAX with MIN < MAX (this job has {} node(s), all required)",
                    plan.nnodes
                );
            }
            let ft =
                crate::train_ft::ft_replica_size(a.ft, &cfg, plan.nproc, plan.nproc * plan.nnodes)?;
            let _lock = lock_ckpt_dir(&a, &plan, embedded)?;
            if plan.nproc * plan.nnodes > 1 || chaos.is_some() {
                launch(&a, &cfg, &plan, chaos.unwrap_or_default(), embedded, ft)
            } else {
                let sup = Supervision::preemptible(term);
                let live = Live::serve(a.metrics_port)?;
                let ended = train::run::run(&cfg, None, &mut Bar::observer(&a, sup, live)?)?;
                Ok(Supervision::ended(term, ended, grace)?)
            }
        }
        Some(w) => {
            let mut cfg = a.run_config()?;
            if a.train.threads.is_none() {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                cfg.train.threads = (cores / w.local_world).max(1);
            }
            cfg.generation = w.rdv.generation;
            let sup = Supervision::worker(&w, term)
                .with_context(|| format!("supervising rank {}", w.rank))?;
            if a.ft {
                let live = Live::publish(a.metrics_port.is_some(), &w.rdv, w.rank)?;
                let (group, ft) =
                    crate::train_ft::ft_worker((a.ft_join_after, a.heartbeat_timeout_s), &cfg, &w)?;
                let mut obs = Bar::observer(&a, sup, live)?;
                let ended = train::run::ft::run(&cfg, group, ft, &mut obs)?;
                return Ok(Supervision::ended(term, ended, grace)?);
            }
            let group = ProcessGroup::new(
                &w.rdv,
                "world",
                w.rank,
                w.world,
                GroupConfig::for_training()?,
            )
            .with_context(|| format!("joining the training group as rank {}", w.rank))?;
            let live = Live::publish(a.metrics_port.is_some(), &w.rdv, w.rank)?;
            let ended = train::run::run(&cfg, Some(group), &mut Bar::observer(&a, sup, live)?)?;
            Ok(Supervision::ended(term, ended, grace)?)
        }
    }
}

/// Node 0 holds the checkpoint directory's lock for the whole job, across worker restarts: a
/// second job on the directory is refused naming the holder ([`ckpt::DirLock`]).
fn lock_ckpt_dir(a: &Args, plan: &NodePlan, embedded: bool) -> Result<Option<ckpt::DirLock>> {
    let dir = a
        .ckpt_dir
        .clone()
        .or_else(|| embedded.then(|| EMBEDDED_CKPT_DIR.into()));
    let Some(dir) = dir.filter(|_| plan.node_rank == 0) else {
        return Ok(None);
    };
    let (lock, previous) = ckpt::DirLock::acquire(&dir)?;
    if let Some(p) = previous {
        println!(
            "# checkpoint directory lock taken over from {p}, which ended without releasing it"
        );
    }
    Ok(Some(lock))
}

/// The lead rank's progress bar with the lines printed above it (hidden on the other ranks
/// and with --no-progress).
struct Bar(ProgressBar);

impl Bar {
    /// The observer of the rank `sup` supervises: the progress bar only on rank 0.
    fn observer(a: &Args, sup: Supervision, live: Live) -> Result<Supervised<Bar>> {
        let hidden = a.no_progress || sup.rank != 0;
        let pb = if hidden {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(0)
        };
        let style = "{bar:30} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]";
        pb.set_style(ProgressStyle::with_template(style).context("progress template")?);
        Ok(Supervised {
            progress: Bar(pb),
            sup,
            live,
        })
    }
}

impl launch::observer::Progress for Bar {
    fn line(&mut self, text: &str) {
        match self.0.is_hidden() || self.0.is_finished() {
            true => println!("{text}"),
            false => self.0.println(text),
        }
    }

    fn start(&mut self, step: u64, steps: u64) {
        self.0.set_length(steps);
        self.0.set_position(step);
    }

    fn step(&mut self, s: &train::StepStats) {
        let tps = s.tokens as f64 / s.seconds;
        self.0
            .set_message(format!("loss {:.4} {tps:.0} tok/s", s.loss));
        self.0.inc(1);
    }

    fn finish(&mut self) {
        self.0.finish_and_clear();
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
    cfg: &RunConfig,
    plan: &NodePlan,
    chaos: launch::Chaos,
    embedded: bool,
    ft: Option<usize>,
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
            cfg.train.steps,
            a.model.config,
            plan.nproc,
            cfg.train.batch,
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
        let peak = gemm_gflops(&model::Threads::new(cores.max(cfg.train.threads))?, 2048, 5);
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
    agent.rdzv_standbys = plan.standbys.clone();
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
    agent.steps = cfg.train.steps;
    agent.ckpt_dir = ckpt_dir;
    agent.admission_timeout = Duration::from_secs_f64(a.admission_timeout_s);
    agent.min_nnodes = plan.min_nnodes;
    agent.term = Some(launch::Termination::install()?);
    agent.term_grace = Duration::from_secs_f64(a.term_grace_s);
    // A worker with --ckpt-dir takes SIGTERM as a pre-emption notice (save, then exit): a
    // restart stops workers at once instead.
    agent.kill_grace = Duration::ZERO;
    (agent.log_dir, agent.run_id) = (a.log_dir.clone(), a.rdzv_id.clone());
    // Node 0's agent serves the whole job (it reads every rank's figures from the store).
    agent.metrics_addr = (a.metrics_port)
        .filter(|_| plan.node_rank == 0)
        .map(|p| std::net::SocketAddr::from(([0, 0, 0, 0], p)));
    agent.agreement = cfg.agreement();
    agent.straggler = a.straggler;
    agent.ft = ft;
    let since_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let report = launch::run(&agent)?;
    if report.restarts > 0 {
        println!(
            "# job finished in generation {} after {} restart(s)",
            report.generation, report.restarts
        );
    }
    if let Some(path) = a.metrics.as_ref().filter(|_| plan.node_rank == 0) {
        let records = train::metrics_log::read_records(path)?;
        if let Some(l) = train::goodput::ledger(&records, since_ms) {
            l.lines().iter().for_each(|l| println!("{l}"));
            train::metrics_log::append_record(path, &train::metrics_log::Record::Goodput(l))?;
        }
    }
    Ok(())
}
