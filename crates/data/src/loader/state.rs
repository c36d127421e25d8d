//! The loader's resumable state: a few numbers, restored in O(1).

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};

/// Largest cursor or step count a resume state may hold (2^62 sequences: far past any run,
/// and far from the sums a loader forms with them overflowing).
pub const MAX_POSITION: u64 = 1 << 62;

/// Where a loader is in the global sequence order, and what that order was made of.
///
/// Everything the order depends on is here (seed, sequence length, shuffle window, mixture
/// weights, the datasets' snapshot ids), so a resume against different data or settings is
/// refused instead of silently continuing a different sequence. Neither the world size nor the
/// worker count is here: they do not change the order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// State format version (1).
    pub version: u32,
    /// Shuffle seed.
    pub seed: u64,
    /// Tokens per sequence (inputs), T.
    pub seq_len: usize,
    /// Shuffle window, in sequences.
    pub shuffle_window: u64,
    /// Integer mixture weights, one per dataset.
    pub weights: Vec<u64>,
    /// Snapshot id of each dataset, in mixture order.
    pub snapshots: Vec<String>,
    /// Global position of the next global batch's first sequence (the global sample cursor).
    pub cursor: u64,
    /// Global batches delivered so far (the step counter).
    pub steps: u64,
    /// Epoch of the first dataset at `cursor` (for people; derived from `cursor`).
    pub epoch: u64,
}

impl LoaderState {
    /// Checks that this state was saved by a loader over the same order.
    ///
    /// # Errors
    /// [`DataError::Mismatch`] naming the first field that differs, with both values.
    pub fn check_matches(&self, current: &LoaderState) -> Result<()> {
        let pairs = [
            (
                "version",
                self.version.to_string(),
                current.version.to_string(),
            ),
            ("seed", self.seed.to_string(), current.seed.to_string()),
            (
                "seq_len",
                self.seq_len.to_string(),
                current.seq_len.to_string(),
            ),
            (
                "shuffle_window",
                self.shuffle_window.to_string(),
                current.shuffle_window.to_string(),
            ),
            (
                "mixture weights",
                format!("{:?}", self.weights),
                format!("{:?}", current.weights),
            ),
            (
                "dataset snapshots",
                self.snapshots.join(","),
                current.snapshots.join(","),
            ),
        ];
        match pairs.into_iter().find(|(_, saved, now)| saved != now) {
            Some((field, saved, now)) => Err(DataError::Mismatch {
                what: "resume state",
                detail: format!("{field} was {saved} when saved, is {now} now"),
            }),
            None => Ok(()),
        }
    }

    /// Checks that the position is one a loader can continue from: the cursor and the step
    /// counter at most [`MAX_POSITION`], so the sums the loader forms from them (a cursor plus
    /// batches ahead, a step plus batches in flight) cannot overflow.
    ///
    /// # Errors
    /// [`DataError::Mismatch`] naming the field and its value.
    pub fn check_position(&self) -> Result<()> {
        for (field, value) in [("cursor", self.cursor), ("steps", self.steps)] {
            if value > MAX_POSITION {
                return Err(DataError::Mismatch {
                    what: "resume state",
                    detail: format!(
                        "{field} {value} is beyond any position (at most {MAX_POSITION})"
                    ),
                });
            }
        }
        Ok(())
    }

    /// The state as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a loader state always serialises")
    }

    /// Parses a state saved by [`LoaderState::to_json`].
    ///
    /// # Errors
    /// [`DataError::Mismatch`] when the text is not a loader state.
    pub fn from_json(text: &str) -> Result<LoaderState> {
        serde_json::from_str(text).map_err(|e| DataError::Mismatch {
            what: "resume state",
            detail: format!("not a loader state: {e}"),
        })
    }
}
