//! Pipeline schedules as explicit per-stage action lists (file 000 lines 2343-2411, Algorithm 1).
//!
//! [`Schedule::new`] orders each stage's computes by the [`ScheduleKind`]'s rule and then places
//! the messages so that the lists cannot deadlock with blocking, unbuffered sends and receives
//! (see `generate.rs` for the construction and its argument); [`Schedule::check`] verifies any
//! list, generated or hand-written, by replay.
use std::fmt;

use super::{Result, ScheduleError};
use super::{check, generate};

/// Upper bound on `p * v * m`, the forwards per schedule; keeps a typo in a config from
/// allocating gigabytes (a 64-stage, 8-virtual-stage, 4096-micro-batch pipeline is 2^21).
pub(super) const MAX_CHUNK_MICROBATCHES: usize = 1 << 24;

/// One step of one stage's list. `chunk` is the stage-local chunk index `c` in `0..v`; the
/// model chunk it holds is `c * p + stage` (see the module doc of [`crate::pipeline`]).
/// Messages name the stage-local chunk on their own side: a send names the chunk that produced
/// the tensor, a receive the chunk that consumes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward of micro-batch `mb` through local chunk `chunk`; keeps its activations.
    Forward {
        /// Micro-batch, `0..m`.
        mb: usize,
        /// Local chunk, `0..v`.
        chunk: usize,
    },
    /// Backward of micro-batch `mb` through local chunk `chunk`; accumulates the chunk's weight
    /// gradients and frees the activations its forward kept (Algorithm 1 step 5).
    Backward {
        /// Micro-batch, `0..m`.
        mb: usize,
        /// Local chunk, `0..v`.
        chunk: usize,
    },
    /// Sends the output of `chunk`'s forward of `mb` to stage `to`, which holds the next model
    /// chunk.
    SendActivation {
        /// Micro-batch.
        mb: usize,
        /// Local chunk that produced the activation.
        chunk: usize,
        /// Destination stage.
        to: usize,
    },
    /// Receives the input of `chunk`'s forward of `mb` from stage `from`.
    RecvActivation {
        /// Micro-batch.
        mb: usize,
        /// Local chunk that will consume it.
        chunk: usize,
        /// Source stage.
        from: usize,
    },
    /// Sends the gradient with respect to `chunk`'s input for `mb` (its backward's output) to
    /// stage `to`, which holds the previous model chunk.
    SendGrad {
        /// Micro-batch.
        mb: usize,
        /// Local chunk that produced the gradient.
        chunk: usize,
        /// Destination stage.
        to: usize,
    },
    /// Receives the gradient with respect to `chunk`'s output for `mb` from stage `from`.
    RecvGrad {
        /// Micro-batch.
        mb: usize,
        /// Local chunk that will consume it.
        chunk: usize,
        /// Source stage.
        from: usize,
    },
    /// The optimizer update of this stage's parameters, once all `m` micro-batches' gradients
    /// are accumulated (Algorithm 1 step 8). Last on every stage, exactly once.
    OptimizerStep,
}

impl Action {
    /// True for [`Action::Forward`] and [`Action::Backward`].
    pub fn is_compute(&self) -> bool {
        matches!(self, Action::Forward { .. } | Action::Backward { .. })
    }

    /// Short label for schedule listings: `F3`, `B3`, `sA3>1` (send activation to stage 1),
    /// `rA3<0`, `sG3>0`, `rG3<1`, `step`; with `v > 1` the local chunk follows a dot (`F3.1`).
    pub fn label(&self, virtual_stages: usize) -> String {
        let ch = |chunk: usize| {
            if virtual_stages > 1 {
                format!(".{chunk}")
            } else {
                String::new()
            }
        };
        match *self {
            Action::Forward { mb, chunk } => format!("F{mb}{}", ch(chunk)),
            Action::Backward { mb, chunk } => format!("B{mb}{}", ch(chunk)),
            Action::SendActivation { mb, chunk, to } => format!("sA{mb}{}>{to}", ch(chunk)),
            Action::RecvActivation { mb, chunk, from } => format!("rA{mb}{}<{from}", ch(chunk)),
            Action::SendGrad { mb, chunk, to } => format!("sG{mb}{}>{to}", ch(chunk)),
            Action::RecvGrad { mb, chunk, from } => format!("rG{mb}{}<{from}", ch(chunk)),
            Action::OptimizerStep => "step".to_string(),
        }
    }
}

/// Long form, used in error messages: `Forward mb 3 chunk 0`, `SendGrad mb 1 chunk 0 to stage 0`.
impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Action::Forward { mb, chunk } => write!(f, "Forward mb {mb} chunk {chunk}"),
            Action::Backward { mb, chunk } => write!(f, "Backward mb {mb} chunk {chunk}"),
            Action::SendActivation { mb, chunk, to } => {
                write!(f, "SendActivation mb {mb} chunk {chunk} to stage {to}")
            }
            Action::RecvActivation { mb, chunk, from } => {
                write!(f, "RecvActivation mb {mb} chunk {chunk} from stage {from}")
            }
            Action::SendGrad { mb, chunk, to } => {
                write!(f, "SendGrad mb {mb} chunk {chunk} to stage {to}")
            }
            Action::RecvGrad { mb, chunk, from } => {
                write!(f, "RecvGrad mb {mb} chunk {chunk} from stage {from}")
            }
            Action::OptimizerStep => write!(f, "OptimizerStep"),
        }
    }
}

/// Which rule orders each stage's forwards and backwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All `m` forwards, then all `m` backwards (GPipe, Huang et al. 2019; file 000 Fig 5.13).
    /// Stage activations peak at `m` micro-batches.
    GPipe,
    /// One-forward-one-backward (000 Algorithm 1; PipeDream-flush): stage `s` runs
    /// `min(p - s - 1, m)` warm-up forwards, then alternates one forward and one backward (the
    /// oldest micro-batch), then drains the remaining backwards. At most `p - s` micro-batches
    /// of activations are held on stage `s` (000 line 2401: peak memory scales with p, not m).
    OneFOneB,
    /// Interleaved 1F1B with `virtual_stages` chunks per stage (Narayanan et al. 2021, the
    /// Megatron-LM schedule; 000 line 2373 only names it). Needs `m % p == 0`. Forwards go in
    /// groups of `p` micro-batches through one chunk before moving to the next chunk; stage `s`
    /// warms up with `min(2 (p - s - 1) + (v - 1) p, v m)` chunk forwards. Bubble
    /// (p-1)/(v m + p-1) with balanced stages, against (p-1)/(m+p-1) for 1F1B, at the price of
    /// `v` times as many messages and more activations: stage 0 holds up to
    /// `min(2 (p - 1) + (v - 1) p + 1, v m)` chunks, each `1/v` of its layers (p = 4, v = 2:
    /// 11 chunks, 5.5 micro-batches' worth against 1F1B's 4).
    Interleaved {
        /// Chunks per stage, `v >= 1`.
        virtual_stages: usize,
    },
}

impl std::str::FromStr for ScheduleKind {
    type Err = String;

    /// `1f1b`, `gpipe` or `interleaved:V` (V >= 1 chunks per stage).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "gpipe" => Ok(ScheduleKind::GPipe),
            _ => match s.strip_prefix("interleaved:").map(str::parse::<usize>) {
                Some(Ok(v)) if v >= 1 => Ok(ScheduleKind::Interleaved { virtual_stages: v }),
                _ => Err(format!(
                    "'{s}': expected 1f1b, gpipe or interleaved:V with V >= 1"
                )),
            },
        }
    }
}

impl ScheduleKind {
    /// Chunks per stage: `v` for [`ScheduleKind::Interleaved`], 1 otherwise.
    pub fn virtual_stages(&self) -> usize {
        match *self {
            ScheduleKind::Interleaved { virtual_stages } => virtual_stages,
            _ => 1,
        }
    }
}

/// A validated pipeline schedule: for each of `p` stages, the literal list of actions it runs
/// for one global batch of `m` micro-batches. Every `Schedule` has passed [`Schedule::check`].
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    kind: ScheduleKind,
    stages: usize,
    microbatches: usize,
    per_stage: Vec<Vec<Action>>,
}

impl Schedule {
    /// Generates the `kind` schedule for `stages` (p) stages and `microbatches` (m)
    /// micro-batches (see the module doc for how messages are placed).
    ///
    /// Errors: `p == 0`, `m == 0`, `v == 0`, interleaved with `m % p != 0`, or `p * v * m` over
    /// 2^24; each names the field and states the rule with the values.
    pub fn new(kind: ScheduleKind, stages: usize, microbatches: usize) -> Result<Schedule> {
        validate(kind, stages, microbatches)?;
        let per_stage = generate::generate(kind, stages, microbatches)?;
        let schedule = Schedule {
            kind,
            stages,
            microbatches,
            per_stage,
        };
        // A generator bug surfaces as an error, never as a wrong schedule.
        schedule.check()?;
        Ok(schedule)
    }

    /// Wraps hand-written lists (one per stage, so `p = per_stage.len()`) after
    /// [`Schedule::check`]ing them. `kind` gives `v` and is kept as a label.
    pub fn from_actions(
        kind: ScheduleKind,
        microbatches: usize,
        per_stage: Vec<Vec<Action>>,
    ) -> Result<Schedule> {
        let stages = per_stage.len();
        if stages == 0 {
            return Err(invalid(
                "pipeline_stages",
                stages,
                "a schedule needs at least one stage (p >= 1)",
            ));
        }
        let schedule = Schedule {
            kind,
            stages,
            microbatches,
            per_stage,
        };
        schedule.check()?;
        Ok(schedule)
    }

    /// Verifies the lists: indices and peers in range; each chunk's forward after its input is
    /// received (or, with one stage, after the previous chunk's forward); each backward after
    /// its own forward and its output gradient; every micro-batch forwarded and backwarded
    /// exactly once per chunk; every message sent after it is computed, exactly once, and
    /// received in the same order it is sent on each link; one optimizer step, last, after all
    /// backwards; and no deadlock when executed with blocking, unbuffered (rendezvous) sends and
    /// receives, hence none with any buffering. Errors name the stage and action.
    pub fn check(&self) -> Result<()> {
        check::check(
            self.stages,
            self.microbatches,
            self.kind.virtual_stages(),
            &self.per_stage,
        )
    }

    /// The rule that generated the schedule (or the label given to [`Schedule::from_actions`]).
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// Number of stages, `p`.
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// Micro-batches per global batch, `m`.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// Chunks per stage, `v`.
    pub fn virtual_stages(&self) -> usize {
        self.kind.virtual_stages()
    }

    /// Stage `stage`'s action list, or `None` past the last stage.
    pub fn actions(&self, stage: usize) -> Option<&[Action]> {
        self.per_stage.get(stage).map(|a| a.as_slice())
    }

    /// All stages' lists, stage 0 first.
    pub fn per_stage(&self) -> &[Vec<Action>] {
        &self.per_stage
    }

    /// Peak number of (micro-batch, chunk) activations `stage` holds at once: forward done,
    /// backward not yet. With `v = 1` that is micro-batches: `m` for GPipe, `min(p - s, m)` for
    /// 1F1B. `None` past the last stage.
    pub fn max_in_flight(&self, stage: usize) -> Option<usize> {
        let list = self.per_stage.get(stage)?;
        let (mut now, mut peak) = (0usize, 0usize);
        for a in list {
            match a {
                Action::Forward { .. } => {
                    now += 1;
                    peak = peak.max(now);
                }
                Action::Backward { .. } => now = now.saturating_sub(1),
                _ => {}
            }
        }
        Some(peak)
    }

    /// One line per stage listing compute actions and the step, e.g. `F0 F1 B0 F2 B1 ...`;
    /// with `comm` the sends and receives too (labels as in [`Action::label`]).
    pub fn render(&self, comm: bool) -> Vec<String> {
        let v = self.virtual_stages();
        self.per_stage
            .iter()
            .map(|list| {
                list.iter()
                    .filter(|a| comm || !is_comm(a))
                    .map(|a| a.label(v))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    }
}

/// `stage 0: F0 F1 B0 ...`, one line per stage; the alternate form (`{:#}`) includes messages.
impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (s, line) in self.render(f.alternate()).iter().enumerate() {
            writeln!(f, "stage {s}: {line}")?;
        }
        Ok(())
    }
}

fn is_comm(a: &Action) -> bool {
    !a.is_compute() && *a != Action::OptimizerStep
}

pub(super) fn invalid(field: &'static str, value: impl ToString, reason: &str) -> ScheduleError {
    ScheduleError::Invalid {
        field,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

fn validate(kind: ScheduleKind, p: usize, m: usize) -> Result<()> {
    if p == 0 {
        return Err(invalid(
            "pipeline_stages",
            p,
            "a pipeline needs at least one stage (p >= 1)",
        ));
    }
    if m == 0 {
        return Err(invalid(
            "microbatches",
            m,
            "a global batch needs at least one micro-batch (m >= 1)",
        ));
    }
    let v = kind.virtual_stages();
    if v == 0 {
        return Err(invalid(
            "virtual_stages",
            v,
            "each stage needs at least one chunk (v >= 1)",
        ));
    }
    if let ScheduleKind::Interleaved { .. } = kind
        && !m.is_multiple_of(p)
    {
        return Err(ScheduleError::Invalid {
            field: "microbatches",
            value: m.to_string(),
            reason: format!(
                "interleaved 1F1B needs microbatches % pipeline_stages == 0, \
                 got {m} % {p} = {}",
                m % p
            ),
        });
    }
    let total = p.checked_mul(v).and_then(|pv| pv.checked_mul(m));
    match total {
        Some(t) if t <= MAX_CHUNK_MICROBATCHES => Ok(()),
        _ => Err(ScheduleError::Invalid {
            field: "microbatches",
            value: m.to_string(),
            reason: format!(
                "pipeline_stages * virtual_stages * microbatches = {p} * {v} * {m} exceeds \
                 {MAX_CHUNK_MICROBATCHES}"
            ),
        }),
    }
}
