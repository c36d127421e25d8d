//! Tokens/s of expert parallelism on this machine beside the planner's prediction (issue 8):
//! the one model with experts in every block (GPT-2's block, 4 layers, C = 256, 4 heads, 8
//! experts of FFN 512, top-2, capacity factor 1.25, vocabulary 4096, tied, 128 tokens a row;
//! [`train::Trainer::expert_parallel`]) trained on one process with
//! the whole global batch of 16 rows (EP 1) and on EP 2 (two ranks as threads, 8 rows each,
//! 4 experts each, two all-to-alls per layer each way). The planner (`plan::step::evaluate`)
//! gets this machine's GEMM rate as the peak and the group's shared-memory link, and the
//! efficiency that makes it match EP 1; the EP 2 row is its prediction.
//!
//! ```text
//! cargo run --release -p flotilla-train --example expert_layouts [-- STEPS]
//! ```

use std::time::Instant;

use comm::group::GroupConfig;
use comm::local::run_threads;
use model::Threads;
use model::config::{ModelConfig, MoeSpec};
use plan::layout::Layout;

#[path = "support/this_machine.rs"]
mod this_machine;
use train::{DataSpec, TrainConfig, Trainer};

/// Rows of every global batch.
const GLOBAL_ROWS: usize = 16;
/// Tokens per row.
const SEQ: usize = 128;

fn config(ep: usize) -> TrainConfig {
    let mut m = ModelConfig::gpt2(4, 4, 256, SEQ, 4096);
    m.ffn = 512;
    m.moe = Some(MoeSpec {
        experts: 8,
        top_k: 2,
        capacity_factor: 1.25,
        aux_weight: 0.01,
    });
    let mut c = TrainConfig::new(m, 0);
    c.batch = GLOBAL_ROWS / ep;
    c.seq_len = SEQ;
    c.lr = 1e-3;
    c.grad_clip = Some(1.0);
    c.seed = 1;
    c.threads = 1;
    c.data = DataSpec::Markov { branching: 4 };
    c
}

/// Mean seconds of the steps after the first on `ep` ranks (rank 0's), and the group's
/// shared-memory α and β.
fn measure(ep: usize, steps: usize) -> Result<(f64, (f64, f64)), Box<dyn std::error::Error>> {
    let out = run_threads(ep, GroupConfig::default(), move |g| {
        let link = g.topology().params(comm::transport::LinkKind::Shm);
        let err = |e: train::TrainError| comm::CommError::InvalidArgument(e.to_string());
        let mut t = match ep {
            1 => Trainer::new(config(ep)),
            _ => Trainer::expert_parallel(config(ep), g, ep, 1 << 20),
        }
        .map_err(err)?;
        let mut secs = Vec::with_capacity(steps);
        for _ in 0..steps {
            let t0 = Instant::now();
            t.step().map_err(err)?;
            secs.push(t0.elapsed().as_secs_f64());
        }
        Ok((
            this_machine::mean_after_first(&secs),
            (link.alpha, link.beta),
        ))
    })?;
    Ok(out.into_iter().next().ok_or("no rank")??)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(4);
    let tokens = (GLOBAL_ROWS * SEQ) as f64;
    let peak = train::metrics::gemm_gflops(&Threads::new(1)?, 1024, 5) * 1e9;
    let (ep1, _) = measure(1, steps)?;
    let (ep2, link) = measure(2, steps)?;

    let job_toml = format!(
        "[model]\nlayers = 4\nhidden = 256\nheads = 4\nffn = 512\nvocab = 4096\nseq = {SEQ}\n\
         experts = 8\ntop_k = 2\ntied_embeddings = true\n[training]\nglobal_batch = {GLOBAL_ROWS}\n\
         precision = \"fp32\"\n"
    );
    let planner = this_machine::Planner::new(job_toml, peak, link);
    // EP ranks are data-parallel replicas of the dense part: the whole global batch as one
    // micro-batch per replica.
    let layout = |ep: u64| Layout {
        ep,
        micro_batch: (GLOBAL_ROWS as u64) / ep,
        sequence_parallel: false,
        ..Layout::new(1, 1, ep)
    };
    let eff = planner.fit(tokens / ep1, &layout(1))?;
    planner.print_beside(
        eff,
        steps,
        (GLOBAL_ROWS, SEQ),
        &[("ep1", ep1, layout(1)), ("ep2", ep2, layout(2))],
    )?;
    Ok(())
}
