//! Verifying shards ahead of the readers.
//!
//! A shard is hashed in full before its first token is used (000: per-shard checksums;
//! [`crate::Dataset::shard`]). Done by the reader that first needs it, every other reader that
//! needs the same shard waits for that hash, so a core idles each time the shuffle window
//! reaches a new shard (measured: readers 73 % busy in a first epoch). This thread walks the
//! sample order ahead of the readers and verifies the shards they will need next, so the hash
//! of the next shard overlaps the row copies of the current ones.
//!
//! It changes nothing about correctness: a shard it has not reached (or whose check failed)
//! is verified by the reader itself, and a failure is reported by that reader, in its batch's
//! place in the order. Only the order of work changes.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use super::Shared;
use crate::dataset::Dataset;
use crate::sampler::{Sampler, SequenceSpace};
use crate::shard::Shard;

/// Probes of the sample order per shuffle window (or per shard, whichever is smaller).
const PROBES_PER_SPAN: u64 = 16;

/// Most shards the verifier keeps mapped (see [`Plan::hold`]).
const MAX_HOLD: usize = 64;

/// Most data the verifier works ahead by, beyond two spans (it pulls that much into the page
/// cache early on a cold read).
const LOOKAHEAD_BYTES: u64 = 1 << 30;

/// Batches claimed between wake-ups of the verifier.
pub(super) const NOTIFY_EVERY: u64 = 16;

/// Where the verifier probes, in global sample positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    /// Positions between probes: small enough to land in every shard of every window.
    pub stride: u64,
    /// How far past the readers' claimed position the verifier works, in sequences: six spans
    /// (a span is a window or the largest shard, whichever is larger) up to
    /// [`LOOKAHEAD_BYTES`], and never under two spans.
    ///
    /// Measured (2 GB dataset, 64 MiB shards, window 65536, first epoch, warm cache; loader
    /// GB/s over raw read, two runs each): 0.5 spans 0.57; 1 span 0.64-0.65; 2 spans 0.66-0.73;
    /// 6 spans 0.71-0.79; 12 spans 0.66-0.69. Too close and readers wait for the hash of the
    /// shard they need; further ahead only reads more of the disk early.
    pub lookahead: u64,
    /// Shards verified ahead that stay mapped until the readers reach them: as many as the
    /// lookahead spans (plus a margin), at most [`MAX_HOLD`]. A shard let go before its first
    /// use is mapped again by the reader, page by page: holding 4 instead of 16 cost 0.66-0.73
    /// of raw against 0.78-0.82 (first epoch, warm, three interleaved pairs).
    pub hold: usize,
}

impl Plan {
    /// The plan for `spaces` shuffled in windows of `window` sequences of `row_bytes` bytes.
    pub fn new(spaces: &[SequenceSpace], window: u64, row_bytes: u64) -> Plan {
        let nonempty = || {
            spaces
                .iter()
                .flat_map(|s| s.per_shard().iter().copied())
                .filter(|&n| n > 0)
        };
        let smallest = nonempty().min().unwrap_or(1);
        let largest = nonempty().max().unwrap_or(1);
        let span = window.max(largest);
        let lookahead = (2 * span).max((6 * span).min(LOOKAHEAD_BYTES / row_bytes.max(1)));
        Plan {
            stride: (window.min(smallest) / PROBES_PER_SPAN).max(1),
            lookahead,
            hold: (lookahead.div_ceil(smallest) as usize + 4).min(MAX_HOLD),
        }
    }
}

/// The verifier thread's loop: from global position `start` (where batch 0 begins), probe the
/// sample order up to `lookahead` past the readers' claims and verify what it finds, sleeping
/// while it is ahead; returns on shutdown, once a batch has failed, or once every shard is
/// verified (later epochs then cost it no wake-ups: it was woken every [`NOTIFY_EVERY`]
/// claims, two context switches each).
pub(super) fn run(
    shared: &Shared,
    datasets: &[Arc<Dataset>],
    mut sampler: Sampler,
    start: u64,
    global_batch: u64,
    plan: Plan,
) {
    let mut probe = start;
    let mut held: VecDeque<Arc<Shard>> = VecDeque::with_capacity(plan.hold + 1);
    loop {
        if datasets.iter().all(|d| d.all_verified()) {
            return;
        }
        let limit = {
            let mut q = shared.lock();
            loop {
                if q.shutdown || q.failed_at.is_some() {
                    return;
                }
                let claimed = start + q.next_claim * global_batch;
                probe = probe.max(claimed);
                if probe < claimed + plan.lookahead {
                    break claimed + plan.lookahead;
                }
                // Woken as the readers claim batches; the timeout only bounds a lost wake-up.
                q = shared
                    .ahead
                    .wait_timeout(q, Duration::from_secs(1))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        };
        // Verify the next shard ahead that still needs it. One shard's hash takes
        // milliseconds, so the queue is looked at again after each.
        while probe < limit {
            let s = sampler.sample(probe);
            probe += plan.stride;
            let dataset = &datasets[s.source as usize];
            if dataset.needs_verification(s.shard as usize) {
                // A failure is left for the reader that needs the shard to report in order.
                if let Ok(shard) = dataset.shard(s.shard as usize) {
                    held.push_back(shard);
                    if held.len() > plan.hold {
                        held.pop_front();
                    }
                }
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_probes_every_shard_and_looks_six_spans_ahead_up_to_a_gib() {
        let a = SequenceSpace::new(&[1000 * 10 + 1, 300 * 10 + 1, 0], 10);
        // Spans of 1000 sequences (the largest shard): six of them, 6000 rows, fit 1 GiB.
        let plan = Plan::new(std::slice::from_ref(&a), 64, 22);
        assert_eq!(
            plan,
            Plan {
                stride: 4,
                lookahead: 6000,
                hold: 6000 / 300 + 4
            }
        );
        // Spans of 65536 sequences of 2 KiB: 1 GiB is 8 spans, so six.
        let wide = Plan::new(std::slice::from_ref(&a), 1 << 16, 2048);
        assert_eq!(
            wide,
            Plan {
                stride: 300 / 16,
                lookahead: 6 << 16,
                hold: MAX_HOLD
            }
        );
        // Rows of 8 KiB: 1 GiB is 2 spans.
        let big = Plan::new(std::slice::from_ref(&a), 1 << 16, 8 << 10);
        assert_eq!(big.lookahead, 2 << 16);
        // Rows of 1 MiB: still two spans.
        let huge = Plan::new(&[a], 1 << 16, 1 << 20);
        assert_eq!(huge.lookahead, 2 << 16);
        // The benchmark's layout (docs/PERFORMANCE.md): 64 MiB shards of 32768 rows of 1025
        // u16 ids, window 65536: six windows ahead span 12 shards, and all 12 stay mapped.
        let bench = SequenceSpace::new(&[32768 * 1024 + 1; 30], 1024);
        let plan = Plan::new(&[bench], 1 << 16, 2050);
        assert_eq!((plan.lookahead, plan.hold), (6 << 16, 12 + 4));
    }
}
