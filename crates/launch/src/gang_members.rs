//! [`Gang`]'s leadership and membership changes: who leads (node 0 until a failover), lost
//! members, nodes waiting to join, stragglers kept out, and the counters a leader taking over
//! needs (see [`crate::failover`]). Part of [`super`], split off for size.

use super::{EXCLUDED_KEY, Gang, key};
use crate::elastic::Membership;
use crate::error::Result;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl Gang<'_> {
    /// The node deciding the generations.
    pub fn leader(&self) -> usize {
        self.leader.load(Ordering::SeqCst)
    }

    /// Whether this node decides the generations.
    pub fn leads(&self) -> bool {
        self.leader() == self.node
    }

    /// Node `node` decides the generations from now on (after a failover).
    pub(crate) fn set_leader(&self, node: usize) {
        self.leader.store(node, Ordering::SeqCst);
    }

    /// The last step any heartbeat read through [`Gang::beat`] showed (what a generation had
    /// reached when its store was lost).
    pub fn last_step_seen(&self) -> Option<u64> {
        self.last_step.load(Ordering::SeqCst).checked_sub(1)
    }

    /// The leader: `node` is known lost (its store went away): it is not waited for at the
    /// next admission, and is admitted again once a lease of it moves.
    pub(crate) fn mark_lost(&self, node: usize) {
        self.leases().lost_now(node, Instant::now());
    }

    /// The nodes dropped as stragglers, as this agent knows them.
    pub(crate) fn excluded(&self) -> Vec<usize> {
        self.excluded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Node 0: drops `node` from every later generation (`--straggler exclude`), and says so
    /// in the store (best effort) so that a leader taking over keeps it out too.
    pub fn exclude(&self, node: usize) {
        let list = {
            let mut e = self.excluded.lock().unwrap_or_else(|p| p.into_inner());
            if !e.contains(&node) {
                e.push(node);
            }
            e.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
        };
        if let Err(e) = self.store.set(EXCLUDED_KEY, list.as_bytes()) {
            tracing::debug!("publishing the excluded nodes: {e}");
        }
    }

    /// Another node: takes the leader's list of excluded nodes (best effort).
    pub(super) fn load_excluded(&self) {
        match self.store.get(EXCLUDED_KEY) {
            Ok(Some(v)) => {
                let list: Vec<usize> = String::from_utf8_lossy(&v)
                    .split(',')
                    .filter_map(|t| t.parse().ok())
                    .collect();
                *self.excluded.lock().unwrap_or_else(|p| p.into_inner()) = list;
            }
            Ok(None) => {}
            Err(e) => tracing::debug!("reading the excluded nodes: {e}"),
        }
    }

    /// Node 0: the first member of `m` (other than node 0) whose lease has stood still for the
    /// lease timeout, with how long, if any.
    pub fn lost_member(&self, m: &Membership) -> Result<Option<(usize, Duration)>> {
        let mut leases = self.leases();
        leases.poll(
            self.store,
            m.nodes.iter().copied().filter(|&n| n != self.node),
        )?;
        let now = Instant::now();
        Ok(m.nodes
            .iter()
            .filter(|&&n| n != self.node)
            .find_map(|&n| Some((n, leases.lost(n, now)?))))
    }

    /// The leader of an elastic job below MAX: a node that registered for generation `g`
    /// after its member list `m` was out (a node returning, or a new one), is not excluded and
    /// renews its lease, if any. The generation then ends so that the next one admits it
    /// (torchelastic's rule: a waiting node restarts the gang while the job is below MAX).
    pub fn waiting_node(&self, g: u64, m: &Membership) -> Result<Option<usize>> {
        if !self.nodes.is_elastic() || m.len() >= self.nodes.max {
            return Ok(None);
        }
        let excluded = self.excluded();
        for n in (0..self.nodes.max).filter(|n| !m.nodes.contains(n) && !excluded.contains(n)) {
            if self.store.get(&key(g, &format!("node/{n}")))?.is_none() {
                continue;
            }
            let mut leases = self.leases();
            leases.poll(self.store, std::iter::once(n))?;
            if leases.live(n, Instant::now()) {
                return Ok(Some(n));
            }
        }
        Ok(None)
    }

    /// The job's restarts so far, as the leader counted them.
    pub fn restarts(&self) -> Result<u64> {
        let v = self.store.get("launch/restarts")?.unwrap_or_default();
        Ok(String::from_utf8_lossy(&v).parse().unwrap_or(0))
    }
}
