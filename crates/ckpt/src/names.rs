//! Names directly under a checkpoint root, in one place for the writer, the reader, the policy
//! code and the CLI. Step numbers are canonical decimal only (no sign, no leading zeros), as the
//! writer creates them, so `step-007` is never mistaken for step 7:
//!
//! ```text
//! step-<N>            a step: committed if it holds COMMIT, else a leftover (crash between
//!                     rename and marker)
//! step-<N>.tmp        a staging directory: in flight, or abandoned by a crash
//! step-<N>.deleting   a committed step being deleted by retention
//! step-<N>.rejected   a committed step that failed to load, set aside by `quarantine`
//!                     (not a recognised name: nothing but a person removes it)
//! ```

/// Suffix of the staging directory of a step.
pub const STAGING_SUFFIX: &str = ".tmp";
/// Suffix of the trash name of a step being deleted.
pub const TRASH_SUFFIX: &str = ".deleting";

/// Name of the directory of a step: `step-<N>`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step}")
}

/// Name of the staging directory of a step: `step-<N>.tmp`.
pub fn tmp_dir_name(step: u64) -> String {
    format!("step-{step}{STAGING_SUFFIX}")
}

/// Name a committed step is renamed to while retention deletes it: `step-<N>.deleting`.
pub fn trash_dir_name(step: u64) -> String {
    format!("step-{step}{TRASH_SUFFIX}")
}

/// What a name directly under a checkpoint root is, by name alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepName {
    /// `step-<N>`.
    Step(u64),
    /// `step-<N>.tmp`.
    Staging(u64),
    /// `step-<N>.deleting`.
    Trash(u64),
}

impl StepName {
    /// The step number.
    pub fn step(self) -> u64 {
        match self {
            StepName::Step(s) | StepName::Staging(s) | StepName::Trash(s) => s,
        }
    }
}

/// Canonical decimal: non-empty ASCII digits, no leading zero unless the number is `0`.
fn parse_canonical(digits: &str) -> Option<u64> {
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    if canonical { digits.parse().ok() } else { None }
}

/// Parses `step-<N>`, `step-<N>.tmp` or `step-<N>.deleting`; anything else is `None`.
pub fn parse_name(name: &str) -> Option<StepName> {
    let rest = name.strip_prefix("step-")?;
    if let Some(d) = rest.strip_suffix(STAGING_SUFFIX) {
        parse_canonical(d).map(StepName::Staging)
    } else if let Some(d) = rest.strip_suffix(TRASH_SUFFIX) {
        parse_canonical(d).map(StepName::Trash)
    } else {
        parse_canonical(rest).map(StepName::Step)
    }
}

/// The step of a `step-<N>` directory name, or `None` for anything else.
pub fn parse_step_name(name: &str) -> Option<u64> {
    match parse_name(name) {
        Some(StepName::Step(s)) => Some(s),
        _ => None,
    }
}

/// What an entry of a checkpoint root is ([`step_dirs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DirState {
    /// `step-<N>` holding a `COMMIT` marker.
    Committed,
    /// `step-<N>` without a marker (a crash between rename and marker).
    NoMarker,
    /// `step-<N>.tmp`: a staging directory.
    Staging,
    /// `step-<N>.deleting`: being deleted by retention.
    Deleting,
}

/// One `step-...` entry of a checkpoint root.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StepDir {
    /// Its step.
    pub step: u64,
    /// Its name under the root.
    pub name: String,
    /// What it is.
    pub state: DirState,
}

/// Every `step-<N>`, `step-<N>.tmp` and `step-<N>.deleting` entry under `root`, by step.
pub fn step_dirs(root: &std::path::Path) -> crate::Result<Vec<StepDir>> {
    let io = |op| crate::error::io_err(op, root);
    let mut found = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io("read_dir"))? {
        let entry = entry.map_err(io("read_dir"))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let (step, state) = match parse_name(&name) {
            Some(StepName::Staging(step)) => (step, DirState::Staging),
            Some(StepName::Step(step)) if entry.path().join("COMMIT").exists() => {
                (step, DirState::Committed)
            }
            Some(StepName::Step(step)) => (step, DirState::NoMarker),
            Some(StepName::Trash(step)) => (step, DirState::Deleting),
            None => continue,
        };
        found.push(StepDir { step, name, state });
    }
    found.sort_by(|a, b| (a.step, &a.name).cmp(&(b.step, &b.name)));
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_canonical() {
        assert_eq!(parse_name("step-0"), Some(StepName::Step(0)));
        assert_eq!(parse_name("step-120"), Some(StepName::Step(120)));
        assert_eq!(parse_name("step-120.tmp"), Some(StepName::Staging(120)));
        assert_eq!(parse_name("step-7.deleting"), Some(StepName::Trash(7)));
        assert_eq!(parse_step_name("step-7.tmp"), None);
        for bad in [
            "step-",
            "step-007",
            "step-+7",
            "step--7",
            "stepx-1",
            "step-7x",
            "step-7.tmp.tmp",
            "step-.tmp",
            "step-07.tmp",
            "step-7.bak",
            "step-7.rejected",
            "Step-7",
            "step-99999999999999999999",
            "step-7.deleting.tmp",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
    }
}
