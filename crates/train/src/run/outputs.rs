//! The run's reports around the loop (its header, the state each rank holds at the end, a
//! save as the slowest rank saw it) and its outputs (`--save`, `--export-hf`).
use comm::group::ProcessGroup;
use comm::mesh::MeshShape;
use model::layout::Layout;

use super::config::RunConfig;
use super::engine::Engine;
use super::report;
use crate::checkpoint::SaveSummary;
use crate::error::{Context, Result};
use crate::forecast::Measured;

/// The lines that open a run: the model, the batch and the MFU denominator, the data's
/// entropy floor when known.
pub(super) fn header(cfg: &RunConfig, engine: &Engine, fpt: f64, peak: f64) -> Vec<String> {
    let t = &cfg.train;
    let m = &t.model;
    let params = Layout::new(m).total;
    let active = if m.moe.is_some() {
        " (active per token)"
    } else {
        ""
    };
    let mut lines = vec![
        format!(
            "# model: {} layers, d_model {}, heads {}/{}, ffn {}, vocab {}, seq_len {}; {:.2}M parameters; {:.1} MFLOP/token{active}",
            m.layers,
            m.d_model,
            m.heads,
            m.kv_heads,
            m.ffn,
            m.vocab,
            t.seq_len,
            params as f64 / 1e6,
            fpt / 1e6
        ),
        format!(
            "# batch {} x {} tokens, {} threads, data {:?}; MFU against {:.1} GFLOP/s ({})",
            t.batch,
            t.seq_len,
            t.threads,
            t.data,
            peak,
            if cfg.peak_gflops.is_some() {
                "given"
            } else {
                "measured 2048^3 GEMM"
            }
        ),
    ];
    if let Engine::Data(tr) = engine
        && let Some(h) = tr.entropy_floor()
    {
        lines.push(format!(
            "# data entropy rate {h:.4} nats/token (the best achievable loss); uniform {:.4}",
            (m.vocab as f64).ln()
        ));
    }
    lines
}

/// The line naming a mesh run's layout.
pub(super) fn mesh_line(cfg: &RunConfig, shape: MeshShape, world: usize, nodes: usize) -> String {
    format!(
        "# mesh: dp {} x pp {} x tp {} over {world} workers on {nodes} host(s){}",
        shape.dp,
        shape.pp,
        shape.tp,
        if shape.pp > 1 {
            format!(
                ", schedule {:?}, {} micro-batches",
                cfg.layout.schedule, cfg.train.grad_accum
            )
        } else {
            String::new()
        }
    )
}

/// A save as the slowest rank of `world` saw it, and its line.
pub(super) fn slowest(
    world: Option<&ProcessGroup>,
    saved: SaveSummary,
) -> Result<(SaveSummary, String)> {
    let saved = super::resume::slowest_rank(world, saved)?;
    let line = report::saved_line(&saved);
    Ok((saved, line))
}

/// The state each rank holds at the end, beside its formula (data parallel) or the planner's
/// figures (mesh runs, the largest rank's; with pipeline stages, the most idle stage's wait
/// beside the planner's bubble). Collective over `group` for mesh runs.
pub(super) fn state_lines(
    engine: &Engine,
    group: Option<&ProcessGroup>,
    planned: Option<&plan::step::Evaluation>,
    measured: &Measured,
) -> Result<Vec<String>> {
    let Some(g) = group else {
        return Ok(vec![]);
    };
    match (engine, planned) {
        (Engine::Data(t), _) => Ok(vec![report::state_line(t)]),
        (mesh, Some(e)) => mesh_state_lines(mesh, g, e, measured),
        (_, None) => Ok(vec![]),
    }
}

/// A mesh run's largest per-rank state beside the planner's, and for pipelines the most idle
/// stage's wait beside the planner's bubble (a collective over `g`).
fn mesh_state_lines(
    engine: &Engine,
    g: &ProcessGroup,
    e: &plan::step::Evaluation,
    measured: &Measured,
) -> Result<Vec<String>> {
    let mem = engine.state_memory();
    let idle = if measured.step_s > 0.0 {
        measured.comm_s / measured.step_s
    } else {
        0.0
    };
    let mut v = [
        mem.params as f64,
        mem.grads as f64,
        mem.optimizer as f64,
        idle,
    ];
    g.all_reduce(&mut v, comm::ReduceOp::Max)
        .ctx(|| "gathering the ranks' state memory".into())?;
    let largest = crate::StateMemory {
        params: v[0] as usize,
        grads: v[1] as usize,
        optimizer: v[2] as usize,
        comm_buffers: 0,
    };
    let mut lines = vec![report::mesh_state_line(largest, &e.memory)];
    if let Engine::Tensor(t) = engine {
        lines.push(report::activation_line(t));
    }
    if matches!(engine, Engine::Pipeline(_)) && measured.steps > 0 {
        lines.push(format!(
            "# pipeline: the most idle stage waited {:.1} % of its steps; planner bubble {:.1} %",
            100.0 * v[3],
            100.0 * e.bubble_fraction
        ));
    }
    Ok(lines)
}

/// `--save` and `--export-hf`: the whole model gathered (a collective), written by the lead
/// rank; the lines saying where.
pub(super) fn write_models(
    cfg: &RunConfig,
    engine: &mut Engine,
    lead: bool,
) -> Result<Vec<String>> {
    if cfg.save.is_none() && cfg.export_hf.is_none() {
        return Ok(vec![]);
    }
    let params = engine.whole_params()?;
    if !lead {
        return Ok(vec![]);
    }
    let t = &cfg.train;
    let mut lines = vec![];
    if let Some(dir) = &cfg.save {
        crate::saved::save(dir, t, &Layout::new(&t.model), &params)?;
        // `flotilla generate --model` finds a Hugging Face tokenizer next to the model.
        if let Some(from) = cfg.init.tokenizer_dir() {
            super::init::copy_tokenizer_files(from, dir)?;
        }
        lines.push(format!("# saved to {}", dir.display()));
    }
    if let Some(dir) = &cfg.export_hf {
        model::interop::export_hf_as(dir, &t.model, &params, cfg.export_dtype)
            .ctx(|| format!("exporting to {}", dir.display()))?;
        // The reference logits are those of the weights as exported.
        let mut exported = params.clone();
        cfg.export_dtype.round(&mut exported);
        write_reference(dir, t, &exported)?;
        let tokenizer = export_tokenizer(cfg, dir)?;
        lines.push(format!(
            "# exported Hugging Face layout to {} ({} weights{tokenizer}; check: python scripts/hf_check.py {})",
            dir.display(),
            cfg.export_dtype.torch_dtype(),
            dir.display()
        ));
    }
    Ok(lines)
}

/// The run's tokenizer as Hugging Face files in the export `dir`: those of the `--init-hf`
/// directory, or the built-in tokenizer's (byte, gpt2) equivalent; a note on what was written.
fn export_tokenizer(cfg: &RunConfig, dir: &std::path::Path) -> Result<String> {
    if let Some(from) = cfg.init.tokenizer_dir() {
        let n = super::init::copy_tokenizer_files(from, dir)?;
        return Ok(format!(", {n} tokenizer file(s) from {}", from.display()));
    }
    let Some(name) = cfg.train.tokenizer_name() else {
        return Ok(String::new());
    };
    let Ok(kind) = name.parse::<data::TokenizerKind>() else {
        // A dataset prepared from a tokenizer.json: its manifest names only the file's hash.
        return Ok(format!(
            ", no tokenizer files (the dataset's tokenizer {name} is a tokenizer.json the run \
             does not hold: copy it next to the export)"
        ));
    };
    for (file, text) in kind.hf_files()? {
        let path = dir.join(file);
        std::fs::write(&path, text).map_err(|source| crate::TrainError::Io { path, source })?;
    }
    Ok(format!(", the {kind} tokenizer as tokenizer.json"))
}

/// Flotilla's logits for one fixed sequence, next to an HF export, so
/// `scripts/hf_check.py` can compare Transformers' logits with ours.
fn write_reference(dir: &std::path::Path, cfg: &crate::TrainConfig, params: &[f32]) -> Result<()> {
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
