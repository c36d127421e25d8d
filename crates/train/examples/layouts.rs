//! Tokens/s of each parallel layout on this machine beside the planner's prediction (issue 8):
//! one process, DP 2, PP 2 (1F1B) and TP 2, the ranks as threads of one process, all on the same
//! global batch of 16 rows. The planner (`plan::step::evaluate`) is given this machine: the
//! GEMM kernel's measured FLOP/s as the peak, the shared-memory link the group measured, and
//! the efficiency that makes it match the one-process run; the three parallel layouts are then
//! its predictions.
//!
//! ```text
//! cargo run --release -p flotilla-train --example layouts [-- STEPS]
//! ```

use comm::group::GroupConfig;
use comm::local::run_threads;
use model::Threads;
use model::config::ModelConfig;
use plan::layout::Layout;

#[path = "support/this_machine.rs"]
mod this_machine;
use train::pipeline::{PipelineStage, ScheduleKind};
use train::{DataSpec, TrainConfig, Trainer};

/// Rows of every global batch.
const GLOBAL_ROWS: usize = 16;
/// Rows per micro-batch.
const MICRO: usize = 4;

fn config(steps: u64, accum: usize) -> TrainConfig {
    let mut c = TrainConfig::new(ModelConfig::gpt2(4, 4, 256, 128, 4096), steps);
    c.batch = MICRO;
    c.grad_accum = accum;
    c.threads = 1;
    c.seed = 1;
    c.data = DataSpec::Markov { branching: 4 };
    c
}

/// Mean of the step seconds after the first.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(4);
    let tokens = (GLOBAL_ROWS * 128) as f64;
    let peak = train::metrics::gemm_gflops(&Threads::new(1)?, 1024, 5) * 1e9;

    let mut one = Trainer::new(config(steps, GLOBAL_ROWS / MICRO))?;
    let secs: Vec<f64> = (0..steps)
        .map(|_| one.step().map(|s| s.seconds))
        .collect::<Result<_, _>>()?;
    let single = this_machine::mean_after_first(&secs);

    // Each layout on 2 ranks; rank 0's step seconds and the group's shared-memory link.
    let two = |layout: &'static str| -> Result<(f64, (f64, f64)), Box<dyn std::error::Error>> {
        let out = run_threads(2, GroupConfig::default(), move |g| {
            let link = g.topology().params(comm::transport::LinkKind::Shm);
            let secs: Result<Vec<f64>, train::TrainError> = match layout {
                "dp2" => {
                    let cfg = config(steps, GLOBAL_ROWS / MICRO / 2);
                    let mut t = Trainer::data_parallel(cfg, g, 1 << 20)
                        .map_err(|e| comm::CommError::InvalidArgument(e.to_string()))?;
                    (0..steps).map(|_| t.step().map(|s| s.seconds)).collect()
                }
                "pp2" => {
                    let cfg = config(steps, GLOBAL_ROWS / MICRO);
                    let mut t = PipelineStage::new(cfg, g, 2, ScheduleKind::OneFOneB)
                        .map_err(|e| comm::CommError::InvalidArgument(e.to_string()))?;
                    (0..steps).map(|_| t.step().map(|s| s.seconds)).collect()
                }
                _ => {
                    let cfg = config(steps, GLOBAL_ROWS / MICRO);
                    let mut t = Trainer::tensor_parallel(cfg, g)
                        .map_err(|e| comm::CommError::InvalidArgument(e.to_string()))?;
                    (0..steps).map(|_| t.step().map(|s| s.seconds)).collect()
                }
            };
            let secs = secs.map_err(|e| comm::CommError::InvalidArgument(e.to_string()))?;
            Ok((
                this_machine::mean_after_first(&secs),
                (link.alpha, link.beta),
            ))
        })?;
        let first = out.into_iter().next().ok_or("no rank")??;
        Ok(first)
    };
    let (dp2, link) = two("dp2")?;
    let (pp2, _) = two("pp2")?;
    let (tp2, _) = two("tp2")?;

    // The planner on this machine, its efficiency fitted to the one-process run.
    let job_toml = format!(
        "[model]\nlayers = 4\nhidden = 256\nheads = 4\nffn = 1024\nvocab = 4096\nseq = 128\n\
         tied_embeddings = true\n[training]\nglobal_batch = {GLOBAL_ROWS}\nprecision = \"fp32\"\n"
    );
    let planner = this_machine::Planner::new(job_toml, peak, link);
    // The engines as built: no sequence parallelism, the embeddings and head replicated on
    // every TP rank (so each computes the whole head).
    let layout = |tp: u64, pp: u64, dp: u64| Layout {
        micro_batch: MICRO as u64,
        sequence_parallel: false,
        vocab_parallel: false,
        ..Layout::new(tp, pp, dp)
    };
    let eff = planner.fit(tokens / single, &layout(1, 1, 1))?;
    planner.print_beside(
        eff,
        steps,
        (GLOBAL_ROWS, 128),
        &[
            ("one", single, layout(1, 1, 1)),
            ("dp2", dp2, layout(1, 1, 2)),
            ("pp2", pp2, layout(1, 2, 1)),
            ("tp2", tp2, layout(2, 1, 1)),
        ],
    )?;
    Ok(())
}
