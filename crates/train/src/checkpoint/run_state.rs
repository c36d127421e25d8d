//! The run state a checkpoint records beside its tensors ([`RunState`], written by every
//! engine) and its reading back ([`SavedRun::parse`]), which validates it against the rest of
//! the checkpoint before anything of it is used.
//!
//! The state arrives inside `manifest.json`, which the checkpoint crate has already read as a
//! regular file under its size cap and matched to its commit marker; what is checked here is
//! what a marker cannot vouch for (a manifest written by a buggy or hostile tool, with a
//! recomputed marker):
//! - exactly the known fields, each of its type (an unknown or nested field is refused, not
//!   ignored);
//! - its `step` is the manifest's step;
//! - AdamW's step count is not past the step;
//! - the replicas that drew the rows (`world`) are between 1 and [`MAX_REPLICAS`];
//! - the row cursor agrees with the batches drawn: `rows_drawn` is `batches_drawn` global
//!   micro-batches of `batch x world` rows (the saving run's, as recorded) plus fewer than one
//!   more (what a resume under another world carries over), and at most
//!   [`MAX_ROWS_PER_STEP_FACTOR`] global batches per step. A resume of the built-in corpora skips every drawn row, so an absurd cursor
//!   would otherwise keep the resume busy for years;
//! - a token-dataset loader's state parses, and its global sample cursor is that row cursor
//!   (so it is bounded too: the loader adds to it every batch).

use std::collections::BTreeMap;

use ckpt::Checkpoint;
use serde::Deserialize;
use serde_json::json;

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};

/// Most data-parallel replicas a run state may record.
pub const MAX_REPLICAS: u64 = 1 << 20;

/// Most rows one step may have drawn, in units of the recording run's `batch x world` rows:
/// the largest gradient accumulation times the largest growth of the world across resumes
/// that a state is believed. A fixed bound (the history of worlds and accumulations is not
/// recorded): it turns a cursor of 10^15 rows after three steps into a refusal, and admits
/// every run that takes fewer than a million micro-batches per step.
pub const MAX_ROWS_PER_STEP_FACTOR: u64 = 1 << 20;

/// The non-tensor state every engine records in a checkpoint (the parent module lists it);
/// `SavedRun::parse` reads it back.
pub struct RunState<'a> {
    /// Steps done.
    pub step: u64,
    /// AdamW's step count.
    pub optimizer_step: u64,
    /// Batches drawn from the data source.
    pub batches_drawn: u64,
    /// Rows drawn: the global cursor of the built-in corpora.
    pub rows_drawn: u64,
    /// The token-dataset loader's own state ([`data::LoaderState::to_json`]), if any.
    pub loader: Option<String>,
    /// Data-parallel replicas that drew the rows.
    pub world: usize,
    /// The run's training config (its seed and model config are recorded).
    pub config: &'a TrainConfig,
}

impl RunState<'_> {
    /// The state as the manifest stores it.
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "step": self.step,
            "optimizer_step": self.optimizer_step,
            "batches_drawn": self.batches_drawn,
            "rows_drawn": self.rows_drawn,
            "loader": self.loader,
            "seed": self.config.seed,
            "world": self.world,
            "batch": self.config.batch,
            "model_config": model::interop::config_to_metadata(&self.config.model),
        })
    }
}

/// The state as stored, every field any engine writes (the MoE engine records its model
/// config as `moe_model_config`); older checkpoints lack `rows_drawn`, `world` and `batch`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    step: u64,
    optimizer_step: u64,
    batches_drawn: u64,
    rows_drawn: Option<u64>,
    loader: Option<String>,
    // Recorded for people and tools (`ckpt convert`), checked for their type only: the seed
    // and the model are in the config hash.
    #[serde(rename = "seed")]
    _seed: Option<u64>,
    world: Option<u64>,
    batch: Option<u64>,
    #[serde(rename = "model_config")]
    _model_config: Option<BTreeMap<String, String>>,
    #[serde(rename = "moe_model_config")]
    _moe_model_config: Option<String>,
}

/// Where a checkpoint left its run, from its validated state.
#[derive(Debug)]
pub(crate) struct SavedRun {
    /// Steps completed.
    pub step: u64,
    /// AdamW's step count.
    pub optimizer_step: u64,
    /// Rows drawn from the data stream (the global cursor of the built-in corpora).
    pub rows: u64,
    /// The token-dataset loader's state, when the run read one.
    pub loader: Option<data::LoaderState>,
}

impl SavedRun {
    /// Reads and validates `ckpt`'s run state (the module doc lists the checks) for a run of
    /// `batch` rows per replica.
    ///
    /// # Errors
    /// [`TrainError::RunState`] naming the checkpoint's manifest, its step and what is wrong.
    pub(crate) fn parse(ckpt: &Checkpoint, batch: usize) -> Result<SavedRun> {
        Self::from_value(ckpt.state(), ckpt.step(), batch).map_err(|reason| TrainError::RunState {
            path: ckpt.dir().join(ckpt::manifest::MANIFEST_FILE),
            step: ckpt.step(),
            reason,
        })
    }

    /// [`SavedRun::parse`] of the state `state` of a manifest of step `step`; the error is the
    /// reason alone.
    pub(crate) fn from_value(
        state: &serde_json::Value,
        step: u64,
        batch: usize,
    ) -> std::result::Result<SavedRun, String> {
        let s = Stored::deserialize(state).map_err(|e| format!("state: {e}"))?;
        if s.step != step {
            return Err(format!(
                "state step {} is not the manifest's step {step}",
                s.step
            ));
        }
        if s.optimizer_step > s.step {
            return Err(format!(
                "optimizer step {} is past the step {}",
                s.optimizer_step, s.step
            ));
        }
        let world = s.world.unwrap_or(1);
        if !(1..=MAX_REPLICAS).contains(&world) {
            return Err(format!("world {world} is not in 1..={MAX_REPLICAS}"));
        }
        // One global micro-batch of the saving run: its rows per replica as recorded (an
        // engine may change them on resume, as the MoE engine does with the EP degree), else
        // this run's.
        let batch = s.batch.unwrap_or(batch as u64);
        if batch == 0 {
            return Err("batch 0".into());
        }
        let per = batch.saturating_mul(world);
        let rows = match s.rows_drawn {
            // Older checkpoints: whole global batches of their world.
            None => s.batches_drawn.checked_mul(per).ok_or_else(|| {
                format!("{} batches drawn overflow the row count", s.batches_drawn)
            })?,
            // Without the saving run's batch only the bounds below apply.
            Some(rows) if s.batch.is_some() && rows / per != s.batches_drawn => {
                return Err(format!(
                    "rows drawn {rows} are not {} batches drawn of {per} rows (batch {batch} \
                     x world {world})",
                    s.batches_drawn
                ));
            }
            Some(rows) => rows,
        };
        let most = s.step.saturating_mul(MAX_ROWS_PER_STEP_FACTOR);
        if s.batches_drawn > most || rows / per > most {
            return Err(format!(
                "{} batches drawn ({rows} rows of {per} per batch) in {} steps (at most \
                 {MAX_ROWS_PER_STEP_FACTOR} per step)",
                s.batches_drawn, s.step
            ));
        }
        let loader = match s.loader {
            Some(text) => Some(
                data::LoaderState::from_json(&text).map_err(|e| format!("loader state: {e}"))?,
            ),
            None => None,
        };
        // The loader's global sample cursor is the row cursor (one row per sample).
        if let (Some(l), Some(_)) = (&loader, s.rows_drawn)
            && l.cursor != rows
        {
            return Err(format!(
                "loader cursor {} is not the {rows} rows drawn",
                l.cursor
            ));
        }
        Ok(SavedRun {
            step: s.step,
            optimizer_step: s.optimizer_step,
            rows,
            loader,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> serde_json::Value {
        json!({"step": 3, "optimizer_step": 3, "batches_drawn": 3, "rows_drawn": 12,
               "loader": null, "seed": 1, "world": 1, "batch": 4, "model_config": {"a": "1"}})
    }

    fn refused(edit: impl FnOnce(&mut serde_json::Value), needle: &str) {
        let mut v = good();
        edit(&mut v);
        let err = SavedRun::from_value(&v, 3, 4).unwrap_err();
        assert!(err.contains(needle), "{err}");
    }

    #[test]
    fn a_consistent_state_is_read() {
        let run = SavedRun::from_value(&good(), 3, 4).unwrap();
        assert_eq!((run.step, run.optimizer_step, run.rows), (3, 3, 12));
        // Carried over from a resume under another world: fewer than one more global batch.
        let mut v = good();
        v["rows_drawn"] = 15.into();
        assert_eq!(SavedRun::from_value(&v, 3, 4).unwrap().rows, 15);
        // Saved with another batch per replica (an MoE run under another EP degree): the
        // recorded batch counts, not this run's.
        assert_eq!(SavedRun::from_value(&good(), 3, 2).unwrap().rows, 12);
        // Without the recorded batch, only a bound.
        let mut v = good();
        v.as_object_mut().unwrap().remove("batch");
        assert_eq!(SavedRun::from_value(&v, 3, 2).unwrap().rows, 12);
        // An old checkpoint without the cursor.
        let mut v = good();
        v.as_object_mut().unwrap().remove("batch");
        v.as_object_mut().unwrap().remove("rows_drawn");
        v.as_object_mut().unwrap().remove("world");
        assert_eq!(SavedRun::from_value(&v, 3, 4).unwrap().rows, 12);
    }

    #[test]
    fn inconsistent_states_are_refused() {
        refused(|v| v["step"] = 4.into(), "manifest's step 3");
        refused(|v| v["optimizer_step"] = 9.into(), "past the step");
        refused(|v| v["world"] = 0.into(), "world 0");
        refused(|v| v["batch"] = 0.into(), "batch 0");
        refused(
            |v| v["rows_drawn"] = 1_000_000_000_000_000u64.into(),
            "rows drawn",
        );
        refused(
            |v| {
                v["batches_drawn"] = (1u64 << 40).into();
                v["rows_drawn"] = (1u64 << 42).into();
            },
            "at most",
        );
        refused(|v| v["nested"] = json!([[[[[1]]]]]), "unknown field");
        refused(|v| v["step"] = "3".into(), "state:");
        refused(|v| v["loader"] = "{}".into(), "loader state");
        let loader = |cursor: u64| {
            format!(
                r#"{{"version":1,"seed":1,"seq_len":32,"shuffle_window":8,"weights":[1],
                "snapshots":["x"],"cursor":{cursor},"steps":3,"epoch":0}}"#
            )
        };
        let mut v = good();
        v["loader"] = loader(12).into();
        assert!(SavedRun::from_value(&v, 3, 4).unwrap().loader.is_some());
        refused(|v| v["loader"] = loader(u64::MAX).into(), "loader cursor");
        refused(|v| *v = json!([1, 2]), "state:");
    }

    /// Any JSON value of limited size and depth.
    fn any_json() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>().prop_map(serde_json::Value::from),
            ".{0,8}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map(".{0,6}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Numbers a hostile tool would write.
    fn hostile_u64() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        prop_oneof![
            Just(0),
            Just(1),
            Just(u64::MAX),
            Just(1 << 63),
            0u64..64,
            any::<u64>()
        ]
    }

    proptest::proptest! {
        // The run state's fuzz target, a fixed budget for CI (well under a second).
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 1024, ..proptest::prelude::ProptestConfig::default()
        })]

        /// Arbitrary JSON in place of the state, or of one of its fields: never a panic.
        #[test]
        fn arbitrary_json_never_panics(
            v in any_json(),
            field in proptest::sample::select(vec!["step", "optimizer_step", "batches_drawn",
                "rows_drawn", "loader", "world", "model_config", "extra"]),
            batch in 0usize..1 << 20,
        ) {
            let _ = SavedRun::from_value(&v, 3, batch);
            let mut state = good();
            state[field] = v;
            let _ = SavedRun::from_value(&state, 3, batch);
        }

        /// Hostile counts: whatever is accepted is consistent and bounded, so a resume that
        /// skips its rows ends.
        #[test]
        fn accepted_counts_are_bounded(
            (step, opt, batches, rows, world) in
                (hostile_u64(), hostile_u64(), hostile_u64(), hostile_u64(), hostile_u64()),
            manifest_step in hostile_u64(),
            batch in 1usize..64,
        ) {
            let v = json!({"step": step, "optimizer_step": opt, "batches_drawn": batches,
                           "rows_drawn": rows, "world": world, "loader": null});
            if let Ok(run) = SavedRun::from_value(&v, manifest_step, batch) {
                proptest::prop_assert_eq!(run.step, manifest_step);
                proptest::prop_assert!(run.optimizer_step <= run.step);
                let per = batch as u64 * world;
                proptest::prop_assert!(run.rows / per <= step.saturating_mul(MAX_ROWS_PER_STEP_FACTOR));
            }
        }
    }
}
