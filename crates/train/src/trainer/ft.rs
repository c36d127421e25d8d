//! A trainer under per-step fault tolerance ([`crate::ft`]): its micro-batches kept until the
//! step commits, so a retried step trains on the same rows, and the state a joining replica
//! receives from a live one.
use std::sync::Arc;

use comm::DType;
use comm::group::{OpOptions, ProcessGroup};
use model::optim::AdamW;

use super::Trainer;
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::ft::FaultTolerance;
use crate::grad::fetch;
use crate::zero::Stage;

/// The micro-batches of the step in progress and the data cursor before them.
#[derive(Default)]
pub(crate) struct Kept {
    /// Inputs and targets of each micro-batch fetched this step.
    batches: Vec<(Vec<u32>, Vec<u32>)>,
    /// The global row cursor before them.
    rows: u64,
    /// The loader's state before them (token datasets).
    loader: Option<data::LoaderState>,
    /// The step is being retried: replay `batches` instead of fetching.
    replay: bool,
}

impl Trainer {
    /// One rank of a fault-tolerant replica group: ZeRO-1 over `replica` (the replica group;
    /// one rank without `--dp-shard`), its reduced parts summed across each step's quorum of
    /// replica groups (`ft`). Every rank draws the rows of its place in the full
    /// data-parallel world, replica group major, as under hybrid sharding.
    pub fn fault_tolerant(
        cfg: TrainConfig,
        replica: ProcessGroup,
        ft: Arc<FaultTolerance>,
        bucket_bytes: usize,
    ) -> Result<Self> {
        let mut t = Self::zero(cfg, replica, Stage::One, bucket_bytes)?;
        if let Some(z) = t.zero.take() {
            t.zero = Some(Box::new(z.with_quorum(ft)));
        }
        t.reset_source(None, 0)?;
        t.kept = Some(Kept::default());
        Ok(t)
    }

    /// The global row cursor as the step starts (what [`next_micro`] keeps for a retry).
    pub(crate) fn rows_at_step_start(&self) -> u64 {
        self.rows_drawn()
    }

    /// The step in progress failed on a lost replica: the next [`Trainer::step`] retries it on
    /// the same micro-batches.
    pub fn retry_step(&mut self) {
        if let Some(k) = self.kept.as_mut() {
            k.replay = !k.batches.is_empty();
        }
    }

    /// A committed step: its micro-batches are no longer needed.
    pub(crate) fn step_committed(&mut self) {
        if let Some(k) = self.kept.as_mut() {
            k.batches.clear();
            k.replay = false;
        }
    }

    /// Copies the training state of rank `root` of `g` (a live replica's rank in the same
    /// place of its replica group) into every rank of `g`: parameters, AdamW's moments and
    /// step, the step count and the data cursor (as before the step in progress). A joining
    /// replica continues from it exactly; the others receive what they hold already.
    pub fn share_state(&mut self, g: &ProcessGroup, root: usize) -> Result<()> {
        let receiving = g.rank() != root;
        let (rows, loader) = match self.kept.as_ref() {
            Some(k) if k.replay => (k.rows, k.loader.clone()),
            _ => (self.rows_drawn(), self.source.loader_state()),
        };
        let mut loader = match loader {
            Some(l) => serde_json::to_vec(&l).map_err(|e| {
                TrainError::FaultTolerance(format!("encoding the loader state: {e}"))
            })?,
            None => Vec::new(),
        };
        let mut counters = [
            self.step as f64,
            rows as f64,
            self.opt.step_count() as f64,
            loader.len() as f64,
        ];
        g.broadcast(&mut counters, root)?;
        loader.resize(counters[3] as usize, 0);
        if !loader.is_empty() {
            g.broadcast_bytes(&mut loader, DType::U8, root, &OpOptions::default())?;
        }
        g.broadcast(&mut self.params[..], root)?;
        let (m, v) = self.opt.moments();
        let (mut m, mut v) = (m.to_vec(), v.to_vec());
        g.broadcast(&mut m, root)?;
        g.broadcast(&mut v, root)?;
        if let Some(master) = self.zero.as_mut().and_then(|z| z.master_mut()) {
            g.broadcast(master, root)?;
        }
        if receiving {
            self.opt = AdamW::from_state(self.cfg.adamw, m, v, counters[2] as u64)?;
            self.step = counters[0] as u64;
            let loader: Option<data::LoaderState> = match loader.is_empty() {
                true => None,
                false => Some(serde_json::from_slice(&loader).map_err(|e| {
                    TrainError::FaultTolerance(format!("decoding the loader state: {e}"))
                })?),
            };
            self.reset_source(loader.as_ref(), counters[1] as u64)?;
            self.kept = Some(Kept::default());
        }
        Ok(())
    }
}

/// The buffers a micro-batch is drawn into.
pub(crate) struct Draw<'a> {
    pub(crate) kept: &'a mut Option<Kept>,
    pub(crate) source: &'a mut crate::source::Source,
    pub(crate) inputs: &'a mut [u32],
    pub(crate) targets: &'a mut [u32],
    pub(crate) drawn: &'a mut u64,
}

/// The next micro-batch (`i` of the step, which began at row cursor `rows`) into the input
/// buffers: fetched, or under fault tolerance replayed when the step is retried. Returns the
/// seconds it waited.
pub(crate) fn next_micro(d: Draw<'_>, i: usize, rows: u64) -> Result<f64> {
    let Some(kept) = d.kept.as_mut() else {
        let s = fetch(d.source, d.inputs, d.targets)?;
        *d.drawn += 1;
        return Ok(s);
    };
    if kept.replay {
        if let Some((x, y)) = kept.batches.get(i) {
            d.inputs.copy_from_slice(x);
            d.targets.copy_from_slice(y);
            return Ok(0.0);
        }
        kept.replay = false;
    }
    if i == 0 {
        kept.batches.clear();
        kept.rows = rows;
        kept.loader = d.source.loader_state();
    }
    let s = fetch(d.source, d.inputs, d.targets)?;
    *d.drawn += 1;
    kept.batches.push((d.inputs.to_vec(), d.targets.to_vec()));
    Ok(s)
}
