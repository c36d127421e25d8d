//! Generation of the schedules' action lists, in two passes (file 000 lines 2343-2411):
//! 1. **Compute order.** Each stage's forwards and backwards are ordered by the schedule's rule
//!    (GPipe: all forwards, then all backwards; 1F1B: Algorithm 1's warm-up, steady state and
//!    drain; interleaved: Megatron's virtual-stage order, see [`ScheduleKind::Interleaved`]).
//! 2. **Communication order.** The compute order is run once through the event-driven timeline
//!    ([`crate::pipeline::simulate`]) with unit costs (a chunk's forward 1, backward 2, no
//!    latency). Every message becomes one event at the time its producer finishes, every compute
//!    one event at its start; the events are sorted by time (messages before computes at equal
//!    times) and each stage's list is the projection of that one global order (a message puts a
//!    send on the producer's list and the receive on the consumer's). Because every stage's list
//!    is a projection of a single sequence in which each message is one joint event, executing
//!    the lists with blocking sends that complete only when the receive is posted (zero
//!    buffering) cannot deadlock: the earliest unexecuted event always has both parties ready.
//!    More buffering only lets sends finish sooner, so the lists are deadlock-free for any
//!    buffer size. [`super::Schedule::check`] verifies this by replay rather than trusting the
//!    argument.
//!
//! The cost of the construction: a receive sits where the message arrived in the unit-cost run,
//! which can be before the compute that needs it (stage 1 of p = 2 receives micro-batch 1's
//! activation before its backward of micro-batch 0). A runtime that posts the receive early
//! (non-blocking, waited on by the compute) loses nothing; one that blocks on it in place waits
//! only when stage costs differ from the unit-cost run.
use super::Result;
use super::schedule::{Action, ScheduleKind};
use super::simulate::{self, Span};

/// The action lists of the `kind` schedule for `p` stages and `m` micro-batches (inputs already
/// validated by [`super::Schedule::new`]).
pub(super) fn generate(kind: ScheduleKind, p: usize, m: usize) -> Result<Vec<Vec<Action>>> {
    let compute = compute_order(kind, p, m);
    let v = kind.virtual_stages();
    // Unit costs per chunk: forward 1, backward 2 (`dataflow` divides stage costs by v).
    let unit_f = vec![v as f64; p];
    let unit_b = vec![2.0 * v as f64; p];
    let spans = simulate::dataflow(p, v, &compute, &unit_f, &unit_b, 0.0)?;
    Ok(project(p, v, &spans))
}

/// Pass 1: each stage's forwards and backwards in the order `kind` runs them.
fn compute_order(kind: ScheduleKind, p: usize, m: usize) -> Vec<Vec<Action>> {
    let f = |mb| Action::Forward { mb, chunk: 0 };
    let b = |mb| Action::Backward { mb, chunk: 0 };
    (0..p)
        .map(|s| match kind {
            ScheduleKind::GPipe => (0..m).map(f).chain((0..m).map(b)).collect(),
            ScheduleKind::OneFOneB => {
                // Algorithm 1: warm-up (step 2), steady 1F1B (steps 3-6), drain (step 7).
                let warm = (p - s - 1).min(m);
                let mut list: Vec<Action> = (0..warm).map(f).collect();
                for i in 0..m - warm {
                    list.push(f(warm + i));
                    list.push(b(i));
                }
                list.extend((m - warm..m).map(b));
                list
            }
            ScheduleKind::Interleaved { virtual_stages: v } => interleaved_order(p, m, v, s),
        })
        .collect()
}

/// Megatron-LM's interleaved order for stage `s` (`forward_backward_pipelining_with_
/// interleaving`): the k-th forward is micro-batch `(k / (p v)) p + k % p` through chunk
/// `(k / p) % v`; the k-th backward the same micro-batch through chunk `v - 1 - (k / p) % v`.
/// Warm-up forwards: `2 (p - s - 1)` to fill the pipeline twice over (a chunk's output comes
/// back round the ring) plus `(v - 1) p` for the earlier chunks of the first group.
fn interleaved_order(p: usize, m: usize, v: usize, s: usize) -> Vec<Action> {
    let total = m * v;
    let mb_of = |k: usize| (k / (p * v)) * p + k % p;
    let fwd = |k: usize| Action::Forward {
        mb: mb_of(k),
        chunk: (k / p) % v,
    };
    let bwd = |k: usize| Action::Backward {
        mb: mb_of(k),
        chunk: v - 1 - (k / p) % v,
    };
    let warm = (2 * (p - s - 1) + (v - 1) * p).min(total);
    let mut list: Vec<Action> = (0..warm).map(fwd).collect();
    for i in 0..total - warm {
        list.push(fwd(warm + i));
        list.push(bwd(i));
    }
    list.extend((total - warm..total).map(bwd));
    list
}

/// One event of the unit-cost run: a compute (one action on its stage) or a message (the send
/// on the producer and the receive on the consumer, as one joint step).
struct Event {
    time: f64,
    /// 0 for a message, 1 for a compute: at equal times a message goes first, so a receive
    /// precedes the compute that starts the moment its input arrives.
    class: u8,
    stage: usize,
    seq: usize,
    emits: Vec<(usize, Action)>,
}

/// Pass 2: the global event order of the unit-cost run, projected onto the stages (module doc).
fn project(p: usize, v: usize, spans: &[Vec<Span>]) -> Vec<Vec<Action>> {
    let mut events: Vec<Event> = Vec::new();
    for (stage, list) in spans.iter().enumerate() {
        for (seq, span) in list.iter().enumerate() {
            events.push(Event {
                time: span.start,
                class: 1,
                stage,
                seq,
                emits: vec![(stage, span.action)],
            });
            if let Some((to, send, recv)) = message_of(p, v, stage, span.action) {
                events.push(Event {
                    time: span.end,
                    class: 0,
                    stage,
                    seq,
                    emits: vec![(stage, send), (to, recv)],
                });
            }
        }
    }
    events.sort_by(|a, b| {
        a.time
            .total_cmp(&b.time)
            .then(a.class.cmp(&b.class))
            .then(a.stage.cmp(&b.stage))
            .then(a.seq.cmp(&b.seq))
    });
    let mut per_stage = vec![Vec::new(); p];
    for event in events {
        for (s, a) in event.emits {
            per_stage[s].push(a);
        }
    }
    for list in &mut per_stage {
        list.push(Action::OptimizerStep);
    }
    per_stage
}

/// The message a compute action on stage `s` produces, if its consumer is on another stage:
/// `(destination, send on s, receive on the destination)`.
pub(super) fn message_of(
    p: usize,
    v: usize,
    s: usize,
    a: Action,
) -> Option<(usize, Action, Action)> {
    let last = p * v - 1;
    match a {
        Action::Forward { mb, chunk } => {
            let k = chunk * p + s;
            let next = k + 1;
            (k < last && next % p != s).then(|| {
                let to = next % p;
                (
                    to,
                    Action::SendActivation { mb, chunk, to },
                    Action::RecvActivation {
                        mb,
                        chunk: next / p,
                        from: s,
                    },
                )
            })
        }
        Action::Backward { mb, chunk } => {
            let k = chunk * p + s;
            (k > 0 && (k - 1) % p != s).then(|| {
                let to = (k - 1) % p;
                (
                    to,
                    Action::SendGrad { mb, chunk, to },
                    Action::RecvGrad {
                        mb,
                        chunk: (k - 1) / p,
                        from: s,
                    },
                )
            })
        }
        _ => None,
    }
}
