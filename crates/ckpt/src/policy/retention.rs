//! Retention: keep the last K committed steps and every Nth step number, never the newest
//! committed step, and delete the rest crash-safely.
//!
//! # How a committed step is deleted
//!
//! 1. `step-<N>` is renamed to `step-<N>.deleting` (the trash name) and the root is fsynced;
//! 2. the trash directory is removed (`remove_dir_all`, which never follows symbolic links).
//!
//! The rename is one atomic step after which no reader sees the step: `step-<N>.deleting` is
//! not a step name for the reader, `flotilla ckpt ls` or [`gc`](fn@super::gc)'s step-number rule. A
//! crash between 1 and 2, or in the middle of 2, leaves a `step-<N>.deleting` that
//! [`gc`](fn@super::gc) removes in every mode, because that name can only be garbage.
//!
//! The alternative, removing `COMMIT` first and then the rest, also hides the step at once, but
//! a crash then leaves a `step-<N>` without a marker, which looks exactly like a save that
//! crashed (or is still running) between its rename and its marker; a collector could then only
//! guess from step numbers whether it may go. The trash name carries its meaning with it.

use std::path::Path;

use super::gc::{EntryKind, Removed};
use super::{PolicyError, remove_tree, tree_bytes};
use crate::error::{CkptError, Result, io_err};
use crate::fsio::fsync_dir;
pub use crate::names::trash_dir_name;
use crate::reader::{list_committed, step_dir_name};

/// Which committed steps to keep.
///
/// A step is kept if it is among the `keep_last` newest committed steps, or if `keep_every` is
/// `Some(n)` and the step *number* is a multiple of `n` (`step % n == 0`), or if it is the
/// newest committed step, which is always kept, whatever the settings: `keep_last: 0` therefore
/// keeps the newest step plus the multiples of `n` (and with `keep_every: None`, just the
/// newest). `keep_every: Some(0)` is refused.
///
/// The newest committed step is the newest with a well-formed commit marker; if its pieces
/// later fail verification, the loader falls back to an older one, so keep at least two when
/// a lost step is expensive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Retention {
    /// How many of the newest committed steps to keep (the newest is kept even if this is 0).
    pub keep_last: usize,
    /// Also keep every step whose number is a multiple of this (must be at least 1).
    pub keep_every: Option<u64>,
}

/// What a [`Retention`] keeps and deletes of a set of committed steps, each ascending.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct RetentionPlan {
    /// Steps kept.
    pub keep: Vec<u64>,
    /// Steps deleted.
    pub delete: Vec<u64>,
}

/// What [`apply`] deleted (or [`preview`] would delete); `flotilla ckpt gc --json` prints it.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct RetentionReport {
    /// The plan that was carried out.
    pub plan: RetentionPlan,
    /// Each directory removed, with the bytes of its files, ascending by step.
    pub removed: Vec<Removed>,
}

impl RetentionReport {
    /// Total bytes of the files removed.
    pub fn bytes_freed(&self) -> u64 {
        self.removed
            .iter()
            .map(|r| r.bytes)
            .fold(0, u64::saturating_add)
    }
}

impl Retention {
    /// Checks the settings: `keep_every` must not be `Some(0)`.
    pub fn validate(&self) -> std::result::Result<(), PolicyError> {
        if self.keep_every == Some(0) {
            return Err(PolicyError {
                what: "keep_every",
                value: "0".into(),
                reason: "must be at least 1 (keep every step whose number is a multiple of it)",
            });
        }
        Ok(())
    }

    /// Splits `committed` (any order; duplicates count once) into steps to keep and to delete.
    /// Pure: touches no file. The newest step is always in `keep`.
    pub fn plan(&self, committed: &[u64]) -> std::result::Result<RetentionPlan, PolicyError> {
        self.validate()?;
        let mut steps = committed.to_vec();
        steps.sort_unstable();
        steps.dedup();
        let first_of_last = steps.len().saturating_sub(self.keep_last.max(1));
        let mut plan = RetentionPlan::default();
        for (i, &step) in steps.iter().enumerate() {
            let recent = i >= first_of_last;
            let milestone = self.keep_every.is_some_and(|n| step % n == 0);
            if recent || milestone {
                plan.keep.push(step);
            } else {
                plan.delete.push(step);
            }
        }
        Ok(plan)
    }
}

/// Deletes the committed steps under `root` that `retention` does not keep (see the module doc
/// for how, and why a crash midway is harmless). Returns the plan and what was removed.
///
/// Only run it while nothing restores from an older step that retention would delete: the
/// newest committed step is never deleted, but a job that fell back past it may be reading one
/// that is.
pub fn apply(root: &Path, retention: &Retention) -> Result<RetentionReport> {
    run(root, retention, false)
}

/// What [`apply`] would delete, with the bytes it would free; deletes nothing.
pub fn preview(root: &Path, retention: &Retention) -> Result<RetentionReport> {
    run(root, retention, true)
}

fn run(root: &Path, retention: &Retention, dry_run: bool) -> Result<RetentionReport> {
    let committed = list_committed(root)?;
    let plan = retention.plan(&committed).map_err(CkptError::Policy)?;
    let mut removed = Vec::new();
    for &step in &plan.delete {
        let path = root.join(step_dir_name(step));
        let bytes = tree_bytes(&path);
        if !dry_run {
            delete_committed(root, step)?;
        }
        removed.push(Removed {
            path,
            step,
            kind: EntryKind::Committed,
            bytes,
        });
    }
    Ok(RetentionReport { plan, removed })
}

/// Renames `step-<N>` to its trash name (fsyncing the root), then removes the trash.
fn delete_committed(root: &Path, step: u64) -> Result<()> {
    let path = root.join(step_dir_name(step));
    let meta = std::fs::symlink_metadata(&path).map_err(io_err("stat", &path))?;
    if meta.file_type().is_symlink() {
        return Err(CkptError::Symlink { path });
    }
    if !meta.is_dir() {
        return Err(not_a_dir(&path));
    }
    let trash = root.join(trash_dir_name(step));
    // A trash directory of the same step left by an earlier crash is garbage already; clear
    // it so the rename below cannot fail on a non-empty target.
    if let Ok(old) = std::fs::symlink_metadata(&trash) {
        if !old.is_dir() {
            return Err(if old.file_type().is_symlink() {
                CkptError::Symlink { path: trash }
            } else {
                not_a_dir(&trash)
            });
        }
        remove_tree(&trash)?;
    }
    std::fs::rename(&path, &trash).map_err(io_err("rename", &path))?;
    fsync_dir(root)?;
    remove_tree(&trash)?;
    fsync_dir(root)
}

fn not_a_dir(path: &Path) -> CkptError {
    io_err("delete", path)(std::io::Error::other("not a directory"))
}
