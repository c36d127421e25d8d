//! The watchdog: turns exit statuses and heartbeats into failures (001 section 12.6).
//!
//! Rules, per worker of the current generation, timed by the agent's clock:
//! - it exited with a non-zero code or was killed by a signal;
//! - its heartbeat value did not change for `heartbeat_timeout` (a stopped or wedged process:
//!   its heartbeat thread is frozen with it), or no beat arrived within `startup_timeout`;
//! - its step did not advance for `watchdog` once it has completed a step in this generation
//!   (a hang inside the loop while the heartbeat thread lives), or it completed no step within
//!   `startup_timeout` (resuming and joining the group are bounded by this instead).

use crate::exit::EXIT_REFUSED;
use crate::heartbeat::Beat;
use std::fmt;
use std::time::{Duration, Instant};

/// The watchdog's limits.
#[derive(Debug, Clone, Copy)]
pub struct WatchRules {
    /// Longest silence of a worker's heartbeat.
    pub heartbeat_timeout: Duration,
    /// Longest time a training step may take (the step must advance within it).
    pub watchdog: Duration,
    /// Longest time from spawn to the first completed step of a generation.
    pub startup_timeout: Duration,
}

impl WatchRules {
    /// The heartbeat period workers are asked for: a fifth of the timeout, within 50 ms..1 s.
    pub fn period(&self) -> Duration {
        (self.heartbeat_timeout / 5).clamp(Duration::from_millis(50), Duration::from_secs(1))
    }
}

/// Why a worker is considered failed.
#[derive(Debug, Clone, PartialEq)]
pub enum FailureKind {
    /// Exited with this non-zero code.
    Exit(i32),
    /// Killed by this signal.
    Signal(i32),
    /// Heartbeat silent for this long.
    Heartbeat(Duration),
    /// Step did not advance for this long (watchdog).
    Stalled(Duration),
    /// No beat or no first step within the startup timeout.
    Startup(Duration),
}

/// The words a refusal's description carries (failures travel between agents as text).
const REFUSED_NOTE: &str = "refused its configuration";

/// Whether a failure description (as [`Failure`] displays it) is a refused configuration.
pub fn is_refusal(what: &str) -> bool {
    what.contains(REFUSED_NOTE)
}

impl FailureKind {
    /// Which failure best explains a group's collapse: a worker killed by a signal or silent
    /// causes its peers' communication errors, not the other way round; a worker that refused
    /// its configuration explains its peers' exits.
    pub fn priority(&self) -> u8 {
        match self {
            FailureKind::Signal(_) => 0,
            FailureKind::Heartbeat(_) => 1,
            FailureKind::Stalled(_) => 2,
            FailureKind::Startup(_) => 3,
            FailureKind::Exit(EXIT_REFUSED) => 4,
            FailureKind::Exit(_) => 5,
        }
    }
}

/// A failed worker: rank, cause and the last step it reported.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// Global rank.
    pub rank: usize,
    /// The cause.
    pub kind: FailureKind,
    /// The last step it completed (from its heartbeats), if known.
    pub step: Option<u64>,
    /// It was inside the next step (waiting there, maybe on a peer) when it failed.
    pub busy: bool,
}

impl Failure {
    /// Sort key naming the root cause among simultaneous failures: the most telling kind
    /// first, then the rank furthest behind (a rank stuck outside a step holds up the peers
    /// that wait for it inside one), then the lowest rank.
    pub fn blame_order(&self) -> (u8, u64, bool, usize) {
        (
            self.kind.priority(),
            self.step.unwrap_or(0),
            self.busy,
            self.rank,
        )
    }
}

/// A signal's name, for messages.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGINT => "SIGINT",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGPIPE => "SIGPIPE",
        _ => "signal",
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} ", self.rank)?;
        match &self.kind {
            FailureKind::Exit(EXIT_REFUSED) => write!(
                f,
                "exited with code {EXIT_REFUSED}: it {REFUSED_NOTE} (its error is printed above)"
            )?,
            FailureKind::Exit(c) => write!(f, "exited with code {c}")?,
            FailureKind::Signal(s) => write!(f, "was killed by signal {s} ({})", signal_name(*s))?,
            FailureKind::Heartbeat(d) => write!(
                f,
                "missed heartbeats for {:.1} s (stopped or dead; heartbeat timeout)",
                d.as_secs_f64()
            )?,
            FailureKind::Stalled(d) => write!(
                f,
                "stalled: its step did not advance for {:.1} s (watchdog)",
                d.as_secs_f64()
            )?,
            FailureKind::Startup(d) => write!(
                f,
                "completed no step within {:.1} s of starting (startup timeout)",
                d.as_secs_f64()
            )?,
        }
        match self.step {
            Some(s) => write!(f, " after step {s}"),
            None => Ok(()),
        }
    }
}

/// What the agent knows of one worker of the current generation.
#[derive(Debug, Clone)]
pub struct WorkerWatch {
    /// Global rank.
    pub rank: usize,
    spawned: Instant,
    last: Option<Beat>,
    beat_changed: Instant,
    step_changed: Instant,
    /// When it first reported a step beyond the one it resumed from.
    pub first_step_at: Option<Instant>,
    /// Exited successfully.
    pub done: bool,
}

impl WorkerWatch {
    /// A worker spawned at `now`.
    pub fn new(rank: usize, now: Instant) -> WorkerWatch {
        WorkerWatch {
            rank,
            spawned: now,
            last: None,
            beat_changed: now,
            step_changed: now,
            first_step_at: None,
            done: false,
        }
    }

    /// The latest beat seen.
    pub fn beat(&self) -> Option<Beat> {
        self.last
    }

    /// Records the beat read from the store at `now` (`None`: none published yet).
    pub fn observe(&mut self, beat: Option<Beat>, now: Instant) {
        let Some(beat) = beat else { return };
        if self.last == Some(beat) {
            return;
        }
        if self.last.map(|b| b.step) != Some(beat.step) {
            self.step_changed = now;
        }
        if self.first_step_at.is_none()
            && matches!((beat.resumed, beat.step), (Some(r), Some(s)) if s > r)
        {
            self.first_step_at = Some(now);
        }
        self.beat_changed = now;
        self.last = Some(beat);
    }

    /// The watchdog's verdict at `now` on a worker still running.
    pub fn check(&self, rules: &WatchRules, now: Instant) -> Option<Failure> {
        let fail = |kind| {
            Some(Failure {
                rank: self.rank,
                kind,
                step: self.last.and_then(|b| b.step),
                busy: self.last.is_some_and(|b| b.busy),
            })
        };
        let since_spawn = now.saturating_duration_since(self.spawned);
        let starting = || {
            if since_spawn > rules.startup_timeout {
                fail(FailureKind::Startup(since_spawn))
            } else {
                None
            }
        };
        let Some(beat) = self.last else {
            return starting();
        };
        let silent = now.saturating_duration_since(self.beat_changed);
        if silent > rules.heartbeat_timeout {
            return fail(FailureKind::Heartbeat(silent));
        }
        if beat.finishing {
            return None;
        }
        if self.first_step_at.is_none() {
            return starting();
        }
        let stalled = now.saturating_duration_since(self.step_changed);
        if stalled > rules.watchdog {
            return fail(FailureKind::Stalled(stalled));
        }
        None
    }

    /// A peer of a rank found stalled after `step`: stuck with it if it has not got past that
    /// step either (in lockstep training every rank waits on the slowest). Ranks cross the
    /// watchdog limit one poll apart, so the first one over it may be a victim waiting inside
    /// the next step; listing the others lets [`Failure::blame_order`] name the culprit.
    pub fn stalled_with(&self, step: u64, now: Instant) -> Option<Failure> {
        let beat = self.last?;
        let own = beat.step?;
        if beat.finishing || own > step || self.first_step_at.is_none() {
            return None;
        }
        Some(Failure {
            rank: self.rank,
            kind: FailureKind::Stalled(now.saturating_duration_since(self.step_changed)),
            step: Some(own),
            busy: beat.busy,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: WatchRules = WatchRules {
        heartbeat_timeout: Duration::from_secs(3),
        watchdog: Duration::from_secs(10),
        startup_timeout: Duration::from_secs(60),
    };

    fn beat(seq: u64, resumed: u64, step: u64) -> Option<Beat> {
        Some(Beat {
            seq,
            resumed: Some(resumed),
            step: Some(step),
            finishing: false,
            busy: false,
        })
    }

    #[test]
    fn silence_stalls_and_slow_starts_are_caught() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut w = WorkerWatch::new(1, t0);
        assert_eq!(w.check(&RULES, s(59)), None, "starting up");
        assert!(matches!(
            w.check(&RULES, s(61)).unwrap().kind,
            FailureKind::Startup(_)
        ));
        w.observe(beat(1, 4, 4), s(1));
        // Resumed but no step yet: only the startup timeout applies to progress.
        w.observe(beat(2, 4, 4), s(3));
        assert_eq!(w.check(&RULES, s(5)), None);
        w.observe(beat(3, 4, 5), s(5));
        assert_eq!(w.first_step_at, Some(s(5)));
        // The heartbeat goes on but the step stays at 5: the watchdog fires after 10 s.
        for seq in 4..20 {
            w.observe(beat(seq, 4, 5), s(5 + seq));
        }
        let f = w.check(&RULES, s(16)).unwrap();
        assert_eq!((f.rank, f.step), (1, Some(5)));
        assert!(matches!(f.kind, FailureKind::Stalled(_)), "{f}");
        // A peer stuck at the same step (outside it) is listed beside the first one caught,
        // and named before it; a peer already past that step is not.
        let mut peer = WorkerWatch::new(0, t0);
        peer.observe(beat(1, 4, 5), s(6));
        let peer_f = peer.stalled_with(5, s(16)).unwrap();
        assert_eq!((peer_f.rank, peer_f.step, peer_f.busy), (0, Some(5), false));
        assert!(
            peer_f.blame_order()
                < Failure {
                    busy: true,
                    ..f.clone()
                }
                .blame_order()
        );
        assert_eq!(peer.stalled_with(4, s(16)), None);
        // A frozen process: the beat stops changing.
        let mut w = WorkerWatch::new(0, t0);
        w.observe(beat(1, 0, 1), s(1));
        assert_eq!(w.check(&RULES, s(4)), None);
        let f = w.check(&RULES, s(5)).unwrap();
        assert!(f.to_string().contains("missed heartbeats"), "{f}");
    }

    #[test]
    fn signals_explain_more_than_exit_codes() {
        assert!(FailureKind::Signal(9).priority() < FailureKind::Exit(1).priority());
        let f = Failure {
            rank: 1,
            kind: FailureKind::Signal(9),
            step: Some(3),
            busy: false,
        };
        assert_eq!(
            f.to_string(),
            "rank 1 was killed by signal 9 (SIGKILL) after step 3"
        );
        // Two stalled ranks at step 3: the one waiting inside step 4 is the victim.
        let victim = Failure {
            rank: 0,
            kind: FailureKind::Stalled(Duration::from_secs(3)),
            step: Some(3),
            busy: true,
        };
        let culprit = Failure {
            rank: 1,
            busy: false,
            ..victim.clone()
        };
        assert!(culprit.blame_order() < victim.blame_order());
    }

    #[test]
    fn a_refused_configuration_explains_its_peers_exits_and_is_recognised() {
        let refused = Failure {
            rank: 2,
            kind: FailureKind::Exit(EXIT_REFUSED),
            step: None,
            busy: false,
        };
        let peer = Failure {
            rank: 0,
            kind: FailureKind::Exit(1),
            ..refused.clone()
        };
        assert!(refused.blame_order() < peer.blame_order());
        let text = refused.to_string();
        assert!(text.starts_with("rank 2 exited with code 78: it refused its configuration"));
        assert!(is_refusal(&text));
        assert!(!is_refusal(&peer.to_string()));
        // Signals and silence still come first.
        assert!(FailureKind::Heartbeat(Duration::ZERO).priority() < refused.kind.priority());
    }
}
