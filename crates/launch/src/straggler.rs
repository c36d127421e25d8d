//! `--straggler warn|exclude` (issue 29): what the job does with a rank the workers named
//! slow (`train::straggler`: its arrival at the step's collectives took at least 1.75x the
//! others' for several steps in a row).
//!
//! The lead worker reports the straggler under [`key`] in the rendezvous store (first report
//! of a generation wins). With [`Policy::Warn`] that is all (the log, the metrics and the
//! flight recorder name it). With [`Policy::Exclude`] in an elastic job (`--nnodes MIN:MAX`),
//! node 0's agent ends the generation when the slow rank's node is not node 0 (which hosts
//! the store) and more than MIN nodes are members; the node is left out of every later
//! generation (node 0 does not admit it again), so the job goes on without it from the last
//! committed checkpoint, as after a lost node.

use crate::error::{LaunchError, Result};
use crate::gang::Gang;
use comm::group::Rendezvous;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// What the job does with a named straggler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Name it (log, metrics, flight recorder) and go on.
    #[default]
    Warn,
    /// Drop its node at a generation boundary (elastic jobs only).
    Exclude,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Policy, String> {
        match s {
            "warn" => Ok(Policy::Warn),
            "exclude" => Ok(Policy::Exclude),
            _ => Err(format!("'{s}': expected warn or exclude")),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Warn => "warn",
            Policy::Exclude => "exclude",
        })
    }
}

/// The store key of generation `g`'s straggler report.
pub fn key(g: u64) -> String {
    format!("launch/g{g}/straggler")
}

/// A straggler as reported to the agents.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    /// The slow rank.
    pub rank: usize,
    /// Its slowdown against the other ranks.
    pub slowdown: f64,
    /// The step at which it was named.
    pub step: u64,
}

impl Report {
    /// `rank slowdown step`.
    pub fn encode(&self) -> String {
        format!("{} {} {}", self.rank, self.slowdown, self.step)
    }

    /// Reads [`Report::encode`]'s text.
    pub fn decode(bytes: &[u8]) -> Option<Report> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut it = text.split_whitespace();
        let r = Report {
            rank: it.next()?.parse().ok()?,
            slowdown: it.next()?.parse().ok()?,
            step: it.next()?.parse().ok()?,
        };
        (it.next().is_none() && r.slowdown.is_finite()).then_some(r)
    }
}

/// A worker (the lead rank): reports `r` for its generation in the store of `rdv`, unless a
/// report is there already.
pub fn report(rdv: &Rendezvous, r: &Report) -> Result<()> {
    let store = rdv.connect(Duration::from_secs(10))?;
    store.compare_set(&key(rdv.generation), None, r.encode().as_bytes())?;
    Ok(())
}

/// Node 0 under [`Policy::Exclude`]: the node to drop for generation `g`'s straggler report,
/// if there is one to act on, with the failure text that ends the generation. A straggler on
/// the leader (node 0 unless the store failed over), or one whose exclusion would leave fewer than `min_nnodes` members, is only named
/// (`said` keeps that from being printed more than once).
pub(crate) fn to_exclude(
    gang: &Gang<'_>,
    g: u64,
    nodes: &[usize],
    nproc: usize,
    min_nnodes: usize,
    said: &mut bool,
) -> Result<Option<(usize, String)>> {
    let Some(text) = gang.store().get(&key(g))? else {
        return Ok(None);
    };
    let r = Report::decode(&text).ok_or_else(|| {
        LaunchError::invalid(
            "straggler report",
            String::from_utf8_lossy(&text),
            "expected RANK SLOWDOWN STEP",
        )
    })?;
    let Some(&node) = nodes.get(r.rank / nproc.max(1)) else {
        return Ok(None);
    };
    let named = format!(
        "straggler: rank {} on node {node} is {:.2}x slower than the others (named at step {})",
        r.rank, r.slowdown, r.step
    );
    let leader = gang.leader();
    if node == leader || nodes.len() <= min_nnodes {
        if !std::mem::replace(said, true) {
            let why = if node == leader {
                format!("node {leader} hosts the store")
            } else {
                "that would leave fewer than MIN nodes".to_string()
            };
            println!("# node {leader}: {named}; not excluded: {why}");
        }
        return Ok(None);
    }
    Ok(Some((
        node,
        format!("{named}; --straggler exclude drops node {node} from the next generation"),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_and_reports_parse() {
        assert_eq!("exclude".parse::<Policy>(), Ok(Policy::Exclude));
        assert_eq!(Policy::Warn.to_string(), "warn");
        assert!(
            "drop"
                .parse::<Policy>()
                .unwrap_err()
                .contains("warn or exclude")
        );
        let r = Report {
            rank: 2,
            slowdown: 3.25,
            step: 9,
        };
        assert_eq!(Report::decode(r.encode().as_bytes()), Some(r));
        assert_eq!(Report::decode(b"2 NaN 9"), None);
        assert_eq!(Report::decode(b"2 3 9 extra"), None);
    }
}
