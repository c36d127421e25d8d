//! Garbage collection of what crashes leave under a checkpoint root: staging directories
//! (`step-<N>.tmp`), published steps without a commit marker (`step-<N>` without `COMMIT`) and
//! retention's trash (`step-<N>.deleting`).
//!
//! A save in flight must never be collected. Saves are sequential, so a save in flight is
//! always of a step newer than the newest committed one; the default mode,
//! [`GcMode::UpToNewestCommitted`], therefore collects staging and unmarked directories only up
//! to the newest committed step (and none while nothing is committed). [`GcMode::AllUncommitted`]
//! collects them all, for use when no job writes to the root. Trash is collected in both modes:
//! only a retention delete creates that name, and it is garbage from the moment it exists.
//!
//! The rule rests on saves being sequential and monotonic: a job that restarted from a step
//! *older* than the newest committed one (because the newest failed verification) saves steps
//! below it, and the default mode would collect such a save in flight. Delete or move a
//! rejected newer step before resuming such a job, or do not run the collector during it.
//!
//! Symbolic links and non-directories bearing a step name are reported as skipped and left
//! alone; so is a `step-<N>` whose `COMMIT` is present but unreadable (a damaged committed step
//! is for a person to look at). Names outside the three patterns are never touched.

use std::path::{Path, PathBuf};

use super::{StepName, remove_tree, scan_names, tree_bytes};
use crate::error::Result;
use crate::fsio::fsync_dir;
use crate::manifest::COMMIT_FILE;
use crate::reader::list_committed;

/// Which uncommitted leftovers [`gc`] collects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GcMode {
    /// Only leftovers of steps at or below the newest committed step (never a save in flight),
    /// plus retention's trash.
    #[default]
    UpToNewestCommitted,
    /// Every leftover, whatever its step: only when no job is writing to the root.
    AllUncommitted,
}

/// What a directory under a checkpoint root is (serialized in snake case: `no_marker` ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    /// `step-<N>` with a well-formed commit marker (deleted only by retention).
    Committed,
    /// `step-<N>.tmp`: a staging directory.
    Staging,
    /// `step-<N>` without `COMMIT`: a crash between the rename and the marker.
    NoMarker,
    /// `step-<N>.deleting`: a retention delete that did not finish.
    Trash,
}

/// One directory removed (or that would be removed, in a preview).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Removed {
    /// Its path.
    pub path: PathBuf,
    /// Its step number.
    pub step: u64,
    /// What it was.
    pub kind: EntryKind,
    /// Bytes of the regular files in it (symbolic links inside count as nothing).
    pub bytes: u64,
}

/// An entry with a step name that [`gc`] left alone, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    /// Its path.
    pub path: PathBuf,
    /// Why it was not removed.
    pub reason: &'static str,
}

/// What [`gc`] removed (or [`preview_gc`] would remove) and what it left alone
/// (`flotilla ckpt gc --json` prints it as is).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct GcReport {
    /// Directories removed, ascending by step.
    pub removed: Vec<Removed>,
    /// Leftovers newer than the newest committed step, kept because a save may be writing
    /// them (default mode only).
    pub in_flight: Vec<PathBuf>,
    /// Entries with a step name that are not safe to remove (symbolic links, files, steps
    /// whose commit marker is present but unreadable).
    pub skipped: Vec<Skipped>,
}

impl GcReport {
    /// Total bytes of the files removed.
    pub fn bytes_freed(&self) -> u64 {
        self.removed
            .iter()
            .map(|r| r.bytes)
            .fold(0, u64::saturating_add)
    }
}

/// Removes the uncommitted leftovers under `root` that `mode` allows (see the module doc).
pub fn gc(root: &Path, mode: GcMode) -> Result<GcReport> {
    run(root, mode, false)
}

/// What [`gc`] would remove, with the bytes it would free; removes nothing.
pub fn preview_gc(root: &Path, mode: GcMode) -> Result<GcReport> {
    run(root, mode, true)
}

fn run(root: &Path, mode: GcMode, dry_run: bool) -> Result<GcReport> {
    let committed = list_committed(root)?;
    let newest = committed.last().copied();
    let mut report = GcReport::default();
    for (name, parsed) in scan_names(root)? {
        let path = root.join(&name);
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue; // vanished since the scan
        };
        if meta.file_type().is_symlink() {
            report.skipped.push(Skipped {
                path,
                reason: "symbolic link: neither followed nor removed",
            });
            continue;
        }
        if !meta.is_dir() {
            report.skipped.push(Skipped {
                path,
                reason: "not a directory",
            });
            continue;
        }
        let (step, kind) = match parsed {
            StepName::Trash(s) => (s, EntryKind::Trash),
            StepName::Staging(s) => (s, EntryKind::Staging),
            StepName::Step(s) if committed.binary_search(&s).is_ok() => continue,
            StepName::Step(s) => {
                if std::fs::symlink_metadata(path.join(COMMIT_FILE)).is_ok() {
                    report.skipped.push(Skipped {
                        path,
                        reason: "commit marker present but unreadable: inspect by hand",
                    });
                    continue;
                }
                (s, EntryKind::NoMarker)
            }
        };
        let collect = match (kind, mode) {
            (EntryKind::Trash, _) | (_, GcMode::AllUncommitted) => true,
            (_, GcMode::UpToNewestCommitted) => newest.is_some_and(|n| step <= n),
        };
        if !collect {
            report.in_flight.push(path);
            continue;
        }
        let bytes = tree_bytes(&path);
        if !dry_run {
            remove_tree(&path)?;
        }
        report.removed.push(Removed {
            path,
            step,
            kind,
            bytes,
        });
    }
    if !dry_run && !report.removed.is_empty() {
        fsync_dir(root)?;
    }
    Ok(report)
}
