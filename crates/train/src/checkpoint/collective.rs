//! The parts of a checkpoint every engine shares, whatever layout saved it or reads it: where
//! the run was ([`saved_run`]), the model's state as whole tensors or any flat range of them
//! ([`read_whole_state`], [`read_state_range`]) with the shape check that refuses another model
//! ([`check_state_tensors`]), and the collective save of the mesh engines
//! ([`save_collectively`]). The format itself is described in the parent module.

use std::path::Path;

use ckpt::{Checkpoint, CheckpointMeta, f32_from_bytes};
use model::layout::Layout;

use super::{
    EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, MODEL_PREFIX, SAVE_TIMEOUT, SavedRun, config_hash,
    state_metas,
};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};

/// Checks that `ckpt` was saved under `cfg`'s training config (its hash) and reads where the
/// run was. Shared by every engine that resumes from the Trainer's format.
pub(crate) fn saved_run(ckpt: &Checkpoint, cfg: &TrainConfig) -> Result<SavedRun> {
    saved_run_hashed(ckpt, &config_hash(cfg), cfg.batch)
}

/// [`saved_run`] against the config hash `want`; `batch` rows per rank only read checkpoints
/// older than the global row cursor.
fn saved_run_hashed(ckpt: &Checkpoint, want: &str, batch: usize) -> Result<SavedRun> {
    let resume = |reason: String| TrainError::Resume {
        step: ckpt.step(),
        reason,
    };
    if ckpt.manifest().config_hash != want {
        return Err(resume(format!(
            "saved under training config {}, this run's is {want} (model, batch, data, \
             optimizer and schedule must match; only --steps, --threads, --grad-accum and \
             the parallel layout may change)",
            ckpt.manifest().config_hash
        )));
    }
    SavedRun::parse(ckpt, batch)
}

/// The newest committed step under `dir`, opened (its manifest verified; each tensor's bytes
/// are verified as read), or `None` when `dir` holds none. The mesh and expert engines resume
/// from it.
pub(crate) fn newest_committed(dir: &Path) -> Result<Option<Checkpoint>> {
    if !dir.exists() {
        return Ok(None);
    }
    let Some(&step) = ckpt::list_committed(dir)?.last() else {
        return Ok(None);
    };
    Ok(Some(Checkpoint::open(
        dir,
        step,
        ckpt::Verify::ManifestOnly,
    )?))
}

/// The whole flat state of `layout` in `ckpt`: parameters, AdamW's first and second moments.
pub(crate) fn read_whole_state(ckpt: &Checkpoint, layout: &Layout) -> Result<[Vec<f32>; 3]> {
    read_state_range(ckpt, layout, 0..layout.total)
}

/// The collective half of a save every rank of a mesh takes part in (the tensor-parallel and
/// pipeline engines): creates `dir`, lets `write(&meta)` put this rank's pieces in its file, agrees
/// over the world that every file is durable (so writer 0 never waits for a writer that gave
/// up), then writer 0 collects the others' piece lists ([`ckpt::handoff`]) and commits `meta`
/// while the others publish theirs, and agrees again (the barrier that keeps every rank from
/// going on before the step is committed). `agree(ok, what)` must fail on every rank whose `ok`
/// is true when any rank's is false; a rank that failed returns its own error.
pub(crate) fn save_collectively(
    dir: &Path,
    step: u64,
    (writer, writers): (u32, u32),
    meta: CheckpointMeta,
    write: impl FnOnce(&CheckpointMeta) -> Result<Vec<ckpt::Piece>>,
    agree: impl Fn(bool, &str) -> Result<()>,
) -> Result<u64> {
    let written = std::fs::create_dir_all(dir)
        .map_err(|e| TrainError::Config {
            field: "checkpoint dir",
            value: dir.display().to_string(),
            reason: e.to_string(),
        })
        .and_then(|()| write(&meta));
    agree(written.is_ok(), "write their pieces of")?;
    let written = written?;
    let committed = if writer == 0 {
        ckpt::handoff::collect_pieces(dir, step, writers, written, SAVE_TIMEOUT)
            .and_then(|all| ckpt::commit(dir, step, all, meta).map(drop))
    } else {
        ckpt::handoff::publish_pieces(dir, step, writer, &written)
    };
    agree(committed.is_ok(), "hand over or commit")?;
    committed?;
    Ok(step)
}

/// The state of `layout`'s flat elements `range` in `ckpt` (parameters, AdamW's first and
/// second moments, each `range.len()` long, indexed from `range.start`): every entry inside it
/// is read whole, an entry it cuts is read whole and its overlap kept. Engines that hold part
/// of the model (a pipeline stage's ranges) read only their entries.
pub(crate) fn read_state_range(
    ckpt: &Checkpoint,
    layout: &Layout,
    range: std::ops::Range<usize>,
) -> Result<[Vec<f32>; 3]> {
    let n = range.len();
    let mut out = [vec![0f32; n], vec![0f32; n], vec![0f32; n]];
    for (prefix, buf) in [MODEL_PREFIX, EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX]
        .into_iter()
        .zip(out.iter_mut())
    {
        for e in &layout.entries {
            let er = e.range();
            let (a, b) = (er.start.max(range.start), er.end.min(range.end));
            let inside = er.start >= range.start && er.end <= range.end;
            if !inside && a >= b {
                continue;
            }
            let name = format!("{prefix}{}", e.name);
            let bytes = ckpt.read_tensor(&name)?;
            let dst = &mut buf[a - range.start..b - range.start];
            if inside {
                f32_from_bytes(&bytes, dst, &name)?;
            } else {
                let mut whole = vec![0f32; er.len()];
                f32_from_bytes(&bytes, &mut whole, &name)?;
                dst.copy_from_slice(&whole[a - er.start..b - er.start]);
            }
        }
    }
    Ok(out)
}

/// Checks that `ckpt` holds exactly the state tensors of `layout` ([`state_metas`]) in their
/// shapes and dtypes; refused naming the first tensor that is missing or differs (another
/// model), or the counts when the checkpoint holds more.
pub(crate) fn check_state_tensors(ckpt: &Checkpoint, layout: &Layout) -> Result<()> {
    check_tensor_metas(ckpt, &state_metas(layout))
}

/// Checks that `ckpt` holds exactly the tensors `want` in their shapes and dtypes.
fn check_tensor_metas(ckpt: &Checkpoint, want: &[ckpt::TensorMeta]) -> Result<()> {
    let resume = |reason: String| TrainError::Resume {
        step: ckpt.step(),
        reason,
    };
    let have = &ckpt.manifest().tensors;
    for t in want {
        match have.iter().find(|h| h.name == t.name) {
            None => {
                return Err(resume(format!(
                    "the checkpoint has no tensor {:?}: saved from another model",
                    t.name
                )));
            }
            Some(h) if h.shape != t.shape || h.dtype != t.dtype => {
                return Err(resume(format!(
                    "tensor {:?} is {:?} {:?} in the checkpoint, {:?} {:?} in this model: \
                     saved from another model",
                    t.name, h.dtype, h.shape, t.dtype, t.shape
                )));
            }
            Some(_) => {}
        }
    }
    if have.len() != want.len() {
        return Err(resume(format!(
            "the checkpoint holds {} tensors, this model's state {}: saved from another model",
            have.len(),
            want.len()
        )));
    }
    Ok(())
}
