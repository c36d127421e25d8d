//! Checkpoint policy: which committed steps to keep ([`Retention`]), collecting what crashes
//! leave behind ([`gc()`]) and how often to save ([`IntervalPlanner`], Young/Daly).
//!
//! It acts on the names of [`crate::names`] (`step-<N>`, `step-<N>.tmp`, `step-<N>.deleting`).
//! Nothing else under the root is ever touched, nothing is followed through a symbolic link,
//! and every function that deletes has a twin that only reports what it would delete
//! ([`preview`], [`preview_gc`]).

mod gc;
mod interval;
mod retention;

pub use gc::{EntryKind, GcMode, GcReport, Removed, Skipped, gc, preview_gc};
pub use interval::{
    Formula, IntervalPlanner, PauseAverage, cluster_mtbf, daly_interval, expected_loss_fraction,
    interval_steps, young_interval,
};
pub use retention::{Retention, RetentionPlan, RetentionReport, apply, preview, trash_dir_name};

use std::path::Path;

use crate::error::{Result, io_err};
pub(crate) use crate::names::{StepName, parse_name};

/// A policy input that is out of range (not finite, not positive, zero where a count must be at
/// least one). Names the parameter and the value that was given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{what} = {value}: {reason}")]
pub struct PolicyError {
    /// The parameter, as named in the API (`mtbf_secs`, `keep_every`, ...).
    pub what: &'static str,
    /// The value given, formatted.
    pub value: String,
    /// What it must be.
    pub reason: &'static str,
}

/// `Ok(x)` if `x` is finite and > 0, else an error naming `what`.
pub(crate) fn positive(what: &'static str, x: f64) -> std::result::Result<f64, PolicyError> {
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(PolicyError {
            what,
            value: x.to_string(),
            reason: "must be a finite number greater than zero",
        })
    }
}

/// `Ok(x)` if `x` is finite and >= 0, else an error naming `what`.
pub(crate) fn non_negative(what: &'static str, x: f64) -> std::result::Result<f64, PolicyError> {
    if x.is_finite() && x >= 0.0 {
        Ok(x)
    } else {
        Err(PolicyError {
            what,
            value: x.to_string(),
            reason: "must be a finite number, zero or greater",
        })
    }
}

/// Every recognised name directly under `root`, as (name, parsed), sorted by step then name.
pub(crate) fn scan_names(root: &Path) -> Result<Vec<(String, StepName)>> {
    let entries = std::fs::read_dir(root).map_err(io_err("read dir", root))?;
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err("read dir", root))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if let Some(parsed) = parse_name(&name) {
            found.push((name, parsed));
        }
    }
    found.sort_by(|a, b| (a.1.step(), &a.0).cmp(&(b.1.step(), &b.0)));
    Ok(found)
}

/// Bytes of the regular files under `path`, never following a symbolic link (a link counts as
/// nothing). Entries that vanish while walking are skipped; this is a report, not a lock.
pub(crate) fn tree_bytes(path: &Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if meta.is_file() {
        return meta.len();
    }
    if !meta.is_dir() {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| tree_bytes(&e.path()))
        .fold(0u64, u64::saturating_add)
}

/// Removes the directory tree at `path` without following symbolic links inside it
/// (`std::fs::remove_dir_all` unlinks links rather than descending, and opens each level
/// relative to its parent). A tree that is already gone counts as removed.
pub(crate) fn remove_tree(path: &Path) -> Result<()> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("remove dir", path)(e)),
    }
}
