//! `flotilla train --tp T` / `--pp P`: one worker of a run on a device mesh (issue 8; 000
//! "混合并行", "层级感知并行", "3D 训练循环").
//!
//! The world of `nproc x nnodes` workers is cut into a mesh of `dp x pp x tp` ranks
//! ([`comm::mesh::DeviceMesh`]: TP fastest, then DP, pipeline stages outermost, so a host-by-host
//! launch keeps each TP group on one host). A TP group that spans hosts is refused before any
//! training, naming the group, its hosts and why; `--force-placement` runs it anyway and prints
//! the warning beside the planner's linter for the same layout. The engine is
//! [`train::tensor::TpTrainer`] (DP x TP) or [`train::pipeline::PipelineStage`] (DP x PP, and
//! DP x PP x TP with Megatron blocks inside each stage).
//!
//! A refused configuration exits with [`launch::EXIT_REFUSED`], which the agent does not
//! restart (the same configuration would be refused again).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use comm::group::ProcessGroup;
use comm::mesh::{DeviceMesh, MeshShape};
use comm::transport::LinkKind;
use train::pipeline::{PipelineStage, ScheduleKind};
use train::tensor::TpTrainer;
use train::{StateMemory, TrainConfig};

use crate::spawn::Supervision;

/// Mesh options of `flotilla train`.
#[derive(clap::Args, Debug, Clone)]
pub struct MeshArgs {
    /// Tensor-parallel degree: each block's attention and MLP split over T ranks (Megatron
    /// column/row-parallel linears, four all-reduces per block per micro-batch), the
    /// embeddings and head replicated. T must divide the world, heads, kv_heads and ffn.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages: the blocks cut into P contiguous stages exchanging activations
    /// point to point; --grad-accum micro-batches per step run under --pipeline-schedule.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Pipeline schedule: 1f1b, gpipe, or interleaved:V (V chunks per stage).
    #[arg(long, default_value = "1f1b", value_parser = parse_schedule)]
    pub pipeline_schedule: ScheduleKind,
    /// Run even when a TP group spans hosts (its four all-reduces per block then cross the
    /// slow link); the refusal becomes a warning.
    #[arg(long)]
    pub force_placement: bool,
}

impl MeshArgs {
    /// Whether the run splits the model (TP or PP), which takes this module's engines.
    pub fn splits_model(&self) -> bool {
        self.tp > 1 || self.pp > 1
    }

    /// The mesh of a `world`-rank job, validated with the equation in the error.
    pub fn shape(&self, world: usize) -> Result<MeshShape> {
        if self.tp == 0 || self.pp == 0 {
            bail!(
                "--tp {} --pp {}: degrees must be at least 1",
                self.tp,
                self.pp
            );
        }
        let mp = self.tp * self.pp;
        if !world.is_multiple_of(mp) {
            bail!(
                "--tp {} x --pp {} = {mp} does not divide the world of {world} workers \
                 (nproc x nnodes); dp = world / (tp x pp) must be whole",
                self.tp,
                self.pp
            );
        }
        let shape = MeshShape::new(world / mp, self.pp, self.tp);
        shape.validate(world).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(shape)
    }
}

/// `1f1b`, `gpipe` or `interleaved:V`.
fn parse_schedule(s: &str) -> Result<ScheduleKind, String> {
    match s {
        "1f1b" => Ok(ScheduleKind::OneFOneB),
        "gpipe" => Ok(ScheduleKind::GPipe),
        _ => match s.strip_prefix("interleaved:").map(str::parse::<usize>) {
            Some(Ok(v)) if v >= 1 => Ok(ScheduleKind::Interleaved { virtual_stages: v }),
            _ => Err(format!(
                "'{s}': expected 1f1b, gpipe or interleaved:V with V >= 1"
            )),
        },
    }
}

/// An error the agent must not restart: the worker exits with [`launch::EXIT_REFUSED`].
#[derive(Debug)]
pub struct Refused(pub anyhow::Error);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for Refused {}

/// Where and how often a mesh run saves (synchronously; every rank writes its pieces, rank 0
/// commits), in the format every layout reads.
pub struct Checkpoints {
    /// The checkpoint directory (resumed from when it holds a committed step).
    pub dir: PathBuf,
    /// Save every this many steps (0: only at the end).
    pub every: u64,
}

/// The engine of one mesh rank.
enum Engine {
    Tensor(Box<TpTrainer>),
    Pipeline(Box<PipelineStage>),
}

/// What one step reported, the same for both engines.
struct Step {
    step: u64,
    loss: f64,
    lr: f32,
    grad_norm: f64,
    seconds: f64,
    /// Pipeline: time blocked in sends and receives (bubble and transfers).
    wait_seconds: f64,
}

impl Engine {
    fn step(&mut self) -> Result<Step> {
        let step = |step, loss, lr, grad_norm, seconds, wait_seconds| Step {
            step,
            loss,
            lr,
            grad_norm,
            seconds,
            wait_seconds,
        };
        Ok(match self {
            Engine::Tensor(t) => {
                let s = t.step()?;
                step(s.step, s.loss, s.lr, s.grad_norm, s.seconds, 0.0)
            }
            Engine::Pipeline(p) => {
                let s = p.step()?;
                step(s.step, s.loss, s.lr, s.grad_norm, s.seconds, s.wait_seconds)
            }
        })
    }

    /// Resumes from the newest committed step under `dir`, if any (a collective).
    fn resume(&mut self, dir: &Path) -> Result<Option<u64>> {
        Ok(match self {
            Engine::Tensor(t) => t.resume(dir)?,
            Engine::Pipeline(p) => p.resume(dir)?,
        })
    }

    /// Saves the current step in the Trainer's format (a collective); returns the step.
    fn save(&mut self, dir: &Path, run_id: &str) -> Result<u64> {
        Ok(match self {
            Engine::Tensor(t) => t.save_checkpoint(dir, run_id)?,
            Engine::Pipeline(p) => p.save_checkpoint(dir, run_id)?,
        })
    }

    fn state_memory(&self) -> StateMemory {
        match self {
            Engine::Tensor(t) => t.state_memory(),
            Engine::Pipeline(p) => p.state_memory(),
        }
    }
}

/// Saves and says so on rank 0.
fn save_line(lead: bool, engine: &mut Engine, c: &Checkpoints, run_id: &str) -> Result<()> {
    let t = Instant::now();
    let step = engine.save(&c.dir, run_id).context("saving a checkpoint")?;
    out!(
        lead,
        "# checkpoint: step {step} committed in {} ({:.1} ms, synchronous)",
        c.dir.display(),
        t.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

/// Rows of one global batch: `dp` replicas x `batch` rows x `grad_accum` micro-batches.
fn global_tokens(cfg: &TrainConfig, dp: usize) -> usize {
    dp * cfg.batch * cfg.grad_accum * cfg.seq_len
}

/// The planner's view of this run: its layout evaluated on this machine's measured numbers
/// (`nnodes` nodes of `nproc` ranks, shared memory inside a node and TCP between nodes, as
/// the group measured them) and the linter's warnings.
fn planner_view(
    cfg: &TrainConfig,
    shape: MeshShape,
    group: &ProcessGroup,
    nodes: usize,
    peak_gflops: f64,
) -> Result<(plan::step::Evaluation, Vec<plan::lint::Warning>)> {
    let topo = group.topology();
    let (shm, tcp) = (topo.params(LinkKind::Shm), topo.params(LinkKind::Tcp));
    let ranks = group.size();
    let c = crate::plan_calibrate::for_run(
        (ranks / nodes.max(1)).max(1) as u64,
        cfg.threads,
        peak_gflops * 1e9,
        (shm.alpha, shm.beta),
        (tcp.alpha, tcp.beta),
    );
    let mut file = crate::plan_calibrate::cluster_file(&c);
    file.nodes = nodes as u64;
    let cluster = plan::cluster::Cluster::from_file(&file)?;
    let job = train::planner::job(
        &cfg.model,
        cfg.seq_len,
        shape.dp * cfg.batch * cfg.grad_accum,
    )?;
    let layout = plan::layout::Layout {
        micro_batch: cfg.batch as u64,
        sequence_parallel: false,
        vocab_parallel: false,
        ..plan::layout::Layout::new(shape.tp as u64, shape.pp as u64, shape.dp as u64)
    };
    let e = plan::step::evaluate(&job, &cluster, &layout)?;
    let warnings = plan::lint::lint(&job, &cluster, &e, &plan::lint::LintConfig::default());
    Ok((e, warnings))
}

/// Trains this worker's part of the mesh run; `peak_gflops` is this rank's share of the
/// machine's GEMM rate (the planner's peak).
pub fn train(
    mesh_args: &MeshArgs,
    cfg: TrainConfig,
    group: ProcessGroup,
    sup: Supervision,
    peak_gflops: f64,
    log_every: u64,
    ckpt: Option<Checkpoints>,
) -> Result<()> {
    let lead = group.rank() == 0;
    let nodes = group.topology().hosts.max(1);
    let shape = mesh_args.shape(group.size()).map_err(Refused)?;
    let mesh = DeviceMesh::new(&group, shape, mesh_args.force_placement).map_err(|e| {
        let e = e.to_string();
        let hint = if e.contains("mesh placement") {
            " (flotilla train --force-placement runs it anyway)"
        } else {
            ""
        };
        Refused(anyhow::anyhow!("{e}{hint}"))
    })?;
    let (plan_eval, lint) = planner_view(&cfg, shape, &group, nodes, peak_gflops)?;
    out!(
        lead,
        "# mesh: dp {} x pp {} x tp {} over {} workers on {} host(s){}",
        shape.dp,
        shape.pp,
        shape.tp,
        group.size(),
        nodes,
        if shape.pp > 1 {
            format!(
                ", schedule {:?}, {} micro-batches",
                mesh_args.pipeline_schedule, cfg.grad_accum
            )
        } else {
            String::new()
        }
    );
    for w in mesh.warnings() {
        out!(lead, "# warning (placement, forced): {w}");
    }
    for w in &lint {
        out!(
            lead,
            "# planner warning [{}]: {} ({})",
            w.code,
            w.message,
            w.cite
        );
    }
    let mut engine = if shape.pp > 1 {
        Engine::Pipeline(Box::new(
            PipelineStage::on_mesh(cfg.clone(), &mesh, mesh_args.pipeline_schedule).map_err(
                |e| Refused(anyhow::Error::new(e).context("building the pipeline stage")),
            )?,
        ))
    } else {
        Engine::Tensor(Box::new(TpTrainer::on_mesh(cfg.clone(), &mesh).map_err(
            |e| Refused(anyhow::Error::new(e).context("building the tensor-parallel rank")),
        )?))
    };
    let run_id = format!("train-seed{}", cfg.seed);
    let first = match &ckpt {
        Some(c) => match engine.resume(&c.dir).context("resuming the mesh run")? {
            Some(step) => {
                out!(lead, "# resumed from {} step {step}", c.dir.display());
                step
            }
            None => 0,
        },
        None => 0,
    };
    sup.resumed(first);
    let tokens = global_tokens(&cfg, shape.dp);
    let (mut timed_s, mut timed_steps, mut wait_s, mut last_loss) = (0.0, 0u64, 0.0, f64::NAN);
    for _ in first..cfg.steps {
        sup.starting();
        let s = engine.step()?;
        last_loss = s.loss;
        if s.step > first + 1 || cfg.steps == first + 1 {
            timed_s += s.seconds;
            timed_steps += 1;
            wait_s += s.wait_seconds;
        }
        if s.step % log_every.max(1) == 0 || s.step == 1 || s.step == cfg.steps {
            out!(
                lead,
                "step {:>6}/{} loss {:.4} lr {:.2e} |g| {:.3} tokens/s {:.0}",
                s.step,
                cfg.steps,
                s.loss,
                s.lr,
                s.grad_norm,
                tokens as f64 / s.seconds
            );
        }
        if let Some(c) = ckpt
            .as_ref()
            .filter(|c| c.every > 0 && s.step % c.every == 0)
        {
            save_line(lead, &mut engine, c, &run_id)?;
        }
        sup.completed(s.step)?;
    }
    sup.finishing();
    // The last step, unless the interval just saved it (or nothing was trained).
    if let Some(c) = ckpt
        .as_ref()
        .filter(|c| c.every == 0 || !cfg.steps.is_multiple_of(c.every))
        && first < cfg.steps
    {
        save_line(lead, &mut engine, c, &run_id)?;
    }
    // Every rank's state, for the per-rank memory line (rank 0 prints the largest).
    let mem = engine.state_memory();
    let idle = if timed_s > 0.0 { wait_s / timed_s } else { 0.0 };
    let mut v = [
        mem.params as f64,
        mem.grads as f64,
        mem.optimizer as f64,
        idle,
    ];
    group
        .all_reduce(&mut v, comm::ReduceOp::Max)
        .context("gathering the ranks' state memory")?;
    group.barrier().context("final barrier")?;
    let tps = tokens as f64 * timed_steps as f64 / f64::max(timed_s, 1e-9);
    out!(
        lead,
        "# done: {} steps, final loss {last_loss:.4}, {tps:.1} tokens/s (steps after the first); planner {:.1} tokens/s",
        cfg.steps,
        plan_eval.tokens_per_s
    );
    let mb = |b: f64| b / 1e6;
    out!(
        lead,
        "# state per rank (largest): params {:.2} MB, grads {:.2} MB, optimizer {:.2} MB; planner {:.2} / {:.2} / {:.2} MB",
        mb(v[0]),
        mb(v[1]),
        mb(v[2]),
        mb(plan_eval.memory.weights),
        mb(plan_eval.memory.grads),
        mb(plan_eval.memory.optimizer)
    );
    if shape.pp > 1 && timed_steps > 0 {
        out!(
            lead,
            "# pipeline: the most idle stage waited {:.1} % of its steps; planner bubble {:.1} %",
            100.0 * v[3],
            100.0 * plan_eval.bubble_fraction
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(tp: usize, pp: usize) -> MeshArgs {
        MeshArgs {
            tp,
            pp,
            pipeline_schedule: ScheduleKind::OneFOneB,
            force_placement: false,
        }
    }

    #[test]
    fn degrees_are_checked_with_the_equation() {
        let s = args(2, 1).shape(4).unwrap();
        assert_eq!((s.dp, s.pp, s.tp), (2, 1, 2));
        let s = args(1, 2).shape(8).unwrap();
        assert_eq!((s.dp, s.pp, s.tp), (4, 2, 1));
        let e = args(3, 1).shape(4).unwrap_err().to_string();
        assert!(
            e.contains("--tp 3 x --pp 1 = 3 does not divide the world of 4"),
            "{e}"
        );
        let s = args(2, 2).shape(8).unwrap();
        assert_eq!((s.dp, s.pp, s.tp), (2, 2, 2));
        assert!(args(0, 1).shape(4).is_err());
        assert!(!args(1, 1).splits_model() && args(2, 1).splits_model());
    }

    #[test]
    fn schedules_parse() {
        assert_eq!(parse_schedule("1f1b"), Ok(ScheduleKind::OneFOneB));
        assert_eq!(parse_schedule("gpipe"), Ok(ScheduleKind::GPipe));
        assert_eq!(
            parse_schedule("interleaved:2"),
            Ok(ScheduleKind::Interleaved { virtual_stages: 2 })
        );
        for bad in ["interleaved:0", "interleaved:x", "zb"] {
            assert!(parse_schedule(bad).unwrap_err().contains(bad), "{bad}");
        }
    }
}
