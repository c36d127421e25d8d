//! Elastic membership: a job of `MIN:MAX` nodes runs each generation on however many of its
//! nodes are alive (at least MIN), and a node whose agent goes silent is dropped at the next
//! generation instead of holding the job hostage (001 sections 12.6-12.8: failures are detected
//! by timeouts and recovered from the last checkpoint; 004 section 28.8, Algorithm 28.2: gang
//! admission with a deadline, members of a generation only).
//!
//! - [`NodeRange`]: `--nnodes N` or `--nnodes MIN:MAX` (torchrun's convention);
//! - [`Membership`]: the nodes the leader admitted to a generation, in rank order (ascending);
//! - [`LeaseKeeper`]: a thread of every other node's agent that renews its membership lease in
//!   the store, so the leader can tell a live agent from a lost host;
//! - [`Leases`]: the leader's view of those leases: a node whose lease has not moved for the
//!   lease timeout is lost.
//!
//! The leader (node 0 at the start) hosts the store and decides every generation. With a list
//! of rendezvous endpoints (`--rdzv H0:P,H1:P,...`) the job survives its loss: the next node of
//! the list re-hosts the store at a fenced generation and leads from there, and a node that
//! comes back is admitted at the next generation boundary ([`crate::failover`]). With a single
//! endpoint, losing node 0 ends the job: the other agents' store requests fail within their
//! timeout and they stop their workers and exit.

use crate::error::{LaunchError, Result};
use comm::store::StoreClient;
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How often an agent renews its lease (well below any sensible lease timeout).
pub const LEASE_PERIOD: Duration = Duration::from_millis(250);

/// The number of nodes a job may run on: any count from `min` to `max` (`min == max`: rigid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    /// Fewest nodes a generation may run on.
    pub min: usize,
    /// Most nodes (the job's node ranks are `0..max`).
    pub max: usize,
}

impl NodeRange {
    /// `min..=max` nodes; refuses `min == 0` and `min > max`, naming the value.
    pub fn new(min: usize, max: usize) -> Result<NodeRange> {
        if min == 0 || min > max {
            return Err(LaunchError::invalid(
                "--nnodes",
                format!("{min}:{max}"),
                "expected N or MIN:MAX with 1 <= MIN <= MAX",
            ));
        }
        Ok(NodeRange { min, max })
    }

    /// Whether a generation may run on fewer than `max` nodes.
    pub fn is_elastic(&self) -> bool {
        self.min < self.max
    }
}

impl From<usize> for NodeRange {
    /// A rigid job of `n` nodes.
    fn from(n: usize) -> NodeRange {
        NodeRange { min: n, max: n }
    }
}

impl FromStr for NodeRange {
    type Err = LaunchError;

    /// `N` (exactly N nodes) or `MIN:MAX`.
    fn from_str(s: &str) -> Result<NodeRange> {
        let number = |t: &str| {
            t.trim().parse::<usize>().map_err(|_| {
                LaunchError::invalid(
                    "--nnodes",
                    s,
                    "expected N or MIN:MAX (whole numbers, e.g. 2:4)",
                )
            })
        };
        match s.split_once(':') {
            Some((lo, hi)) => NodeRange::new(number(lo)?, number(hi)?),
            None => {
                let n = number(s)?;
                NodeRange::new(n, n)
            }
        }
    }
}

impl fmt::Display for NodeRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_elastic() {
            write!(f, "{}:{}", self.min, self.max)
        } else {
            write!(f, "{}", self.max)
        }
    }
}

/// The nodes of one generation, in rank order: `nodes[slot]` runs global ranks
/// `slot * nproc .. (slot + 1) * nproc`, ascending node ids (node 0 first while it is a member;
/// after a failover the leader need not be).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    /// Node ids (`--node-rank`) of the members, ascending.
    pub nodes: Vec<usize>,
}

impl Membership {
    /// The text node 0 publishes: ids joined by commas.
    pub fn encode(&self) -> String {
        let ids: Vec<String> = self.nodes.iter().map(usize::to_string).collect();
        ids.join(",")
    }

    /// Parses [`Membership::encode`]'s text; `None` if malformed (not ascending ids).
    pub fn decode(text: &[u8]) -> Option<Membership> {
        let text = std::str::from_utf8(text).ok()?;
        let nodes = text
            .split(',')
            .map(|t| t.parse().ok())
            .collect::<Option<Vec<usize>>>()?;
        (nodes.windows(2).all(|w| w[0] < w[1])).then_some(Membership { nodes })
    }

    /// Node `node`'s position (its block of ranks), if it is a member.
    pub fn slot(&self, node: usize) -> Option<usize> {
        self.nodes.iter().position(|&n| n == node)
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether there are none (never, for an admitted generation).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// The store key of node `node`'s lease (not generation-scoped: it outlives generations).
pub fn lease_key(node: usize) -> String {
    format!("launch/lease/{node}")
}

/// A thread renewing this node's lease every [`LEASE_PERIOD`] until dropped. It follows the
/// store's generation (requests are fenced), and a failed renewal is only logged: node 0 judges
/// by the lease, so a cut-off node simply stops counting as alive.
pub struct LeaseKeeper {
    stop: Option<mpsc::Sender<()>>,
}

impl LeaseKeeper {
    /// Starts renewing `node`'s lease through a clone of `store`. The first renewal is made
    /// here, before the caller registers for a generation, so the lease exists by the time node 0
    /// admits this node.
    pub fn start(store: &StoreClient, node: usize) -> Result<LeaseKeeper> {
        let client = store.try_clone()?;
        let (tx, rx) = mpsc::channel::<()>();
        let key = lease_key(node);
        let mut count: u64 = 1;
        client.set(&key, count.to_string().as_bytes())?;
        std::thread::Builder::new()
            .name(format!("lease-{node}"))
            .spawn(move || {
                // Sleeps between renewals; a message or a dropped sender ends the thread.
                while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(LEASE_PERIOD) {
                    count += 1;
                    let renew = || client.set(&key, count.to_string().as_bytes());
                    if let Err(comm::CommError::StaleGeneration { current, .. }) = renew() {
                        client.set_generation(current);
                        if let Err(e) = renew() {
                            tracing::debug!("lease renewal: {e}");
                        }
                    }
                }
            })
            .map_err(|e| LaunchError::io("start the lease thread", e))?;
        Ok(LeaseKeeper { stop: Some(tx) })
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        // The thread sees the disconnect at its next wake-up (within LEASE_PERIOD); it is not
        // joined, since a renewal to an unreachable store may take the store's request timeout.
        self.stop.take();
    }
}

/// Node 0's record of every other node's lease: its last value and when node 0 saw it change.
pub struct Leases {
    timeout: Duration,
    seen: HashMap<usize, (Vec<u8>, Instant)>,
}

impl Leases {
    /// A node whose lease stands still for `timeout` is lost.
    pub fn new(timeout: Duration) -> Leases {
        Leases {
            timeout,
            seen: HashMap::new(),
        }
    }

    /// The lease timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Reads the leases of `nodes` from the store.
    pub fn poll(&mut self, store: &StoreClient, nodes: impl Iterator<Item = usize>) -> Result<()> {
        let now = Instant::now();
        for n in nodes {
            if let Some(v) = store.get(&lease_key(n))? {
                self.observe(n, v, now);
            }
        }
        Ok(())
    }

    /// Records lease value `v` of `node` read at `now`.
    pub fn observe(&mut self, node: usize, v: Vec<u8>, now: Instant) {
        match self.seen.get_mut(&node) {
            Some((old, at)) if *old != v => (*old, *at) = (v, now),
            Some(_) => {}
            None => {
                self.seen.insert(node, (v, now));
            }
        }
    }

    /// Starts the clock of a node admitted at `now` whose lease was never seen: if no renewal
    /// arrives within the timeout, it is lost. (A job can fail within a few hundred milliseconds
    /// of admission, before node 0 has read a member's lease; without this, such a member
    /// would never be judged and only a collective's timeout would notice it.)
    pub fn admitted(&mut self, node: usize, now: Instant) {
        self.seen.entry(node).or_insert((Vec::new(), now));
    }

    /// Records that `node` is lost as of `now` (its host's store went away): it counts as lost
    /// until a lease value other than any seen arrives.
    pub fn lost_now(&mut self, node: usize, now: Instant) {
        let since = now.checked_sub(self.timeout).unwrap_or(now);
        self.seen.insert(node, (Vec::new(), since));
    }

    /// Whether `node`'s lease was seen and has not stood still for the timeout.
    pub fn live(&self, node: usize, now: Instant) -> bool {
        self.seen.contains_key(&node) && self.lost(node, now).is_none()
    }

    /// How long `node`'s lease has stood still, if it is lost (seen or admitted, then silent for
    /// the timeout). A node neither seen nor admitted is not judged here: admission's deadline
    /// covers it.
    pub fn lost(&self, node: usize, now: Instant) -> Option<Duration> {
        let (_, at) = self.seen.get(&node)?;
        let still = now.saturating_duration_since(*at);
        (still >= self.timeout).then_some(still)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ranges_parse_and_bad_ones_are_named() {
        assert_eq!("3".parse::<NodeRange>().unwrap(), NodeRange::from(3));
        let r: NodeRange = "2:3".parse().unwrap();
        assert_eq!((r.min, r.max, r.is_elastic()), (2, 3, true));
        assert_eq!(r.to_string(), "2:3");
        assert_eq!(NodeRange::from(4).to_string(), "4");
        for bad in ["0", "3:2", "0:2", "two", "1:", ":4", "1:2:3", ""] {
            let e = bad.parse::<NodeRange>().unwrap_err().to_string();
            assert!(e.contains("--nnodes") && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn memberships_round_trip_in_ascending_order() {
        let m = Membership {
            nodes: vec![0, 1, 3],
        };
        assert_eq!(Membership::decode(m.encode().as_bytes()), Some(m.clone()));
        assert_eq!((m.slot(3), m.slot(2), m.len()), (Some(2), None, 3));
        // After a failover node 0 may be gone; ids stay ascending.
        assert_eq!(
            Membership::decode(b"1,2").map(|m| m.nodes),
            Some(vec![1, 2])
        );
        assert_eq!(Membership::decode(b"2,1"), None);
        assert_eq!(Membership::decode(b"0,x"), None);
    }

    #[test]
    fn a_lease_that_stands_still_is_lost() {
        let mut l = Leases::new(Duration::from_secs(3));
        let t0 = Instant::now();
        assert_eq!(l.lost(1, t0 + Duration::from_secs(60)), None);
        l.observe(1, b"1".to_vec(), t0);
        l.observe(1, b"2".to_vec(), t0 + Duration::from_secs(2));
        l.observe(1, b"2".to_vec(), t0 + Duration::from_secs(4));
        assert_eq!(l.lost(1, t0 + Duration::from_secs(4)), None);
        assert_eq!(
            l.lost(1, t0 + Duration::from_secs(5)),
            Some(Duration::from_secs(3))
        );
    }

    #[test]
    fn an_admitted_node_whose_lease_never_arrives_is_lost() {
        let mut l = Leases::new(Duration::from_secs(3));
        let t0 = Instant::now();
        l.admitted(2, t0);
        assert_eq!(l.lost(2, t0 + Duration::from_secs(2)), None);
        assert_eq!(
            l.lost(2, t0 + Duration::from_secs(3)),
            Some(Duration::from_secs(3))
        );
        // A renewal restarts the clock; admitting again does not.
        l.observe(2, b"1".to_vec(), t0 + Duration::from_secs(3));
        l.admitted(2, t0 + Duration::from_secs(10));
        assert_eq!(l.lost(2, t0 + Duration::from_secs(5)), None);
        assert_eq!(
            l.lost(2, t0 + Duration::from_secs(6)),
            Some(Duration::from_secs(3))
        );
    }
}
