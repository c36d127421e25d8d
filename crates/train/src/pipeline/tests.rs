//! Tests for the pipeline schedules: dependency checks over a grid, hand-broken schedules,
//! in-flight bounds, bubbles against 000 F41, and golden listings written from Algorithm 1.
use super::schedule::Action::{self, *};
use super::{Schedule, ScheduleError, ScheduleKind};

const KINDS: [ScheduleKind; 5] = [
    ScheduleKind::GPipe,
    ScheduleKind::OneFOneB,
    ScheduleKind::Interleaved { virtual_stages: 1 },
    ScheduleKind::Interleaved { virtual_stages: 2 },
    ScheduleKind::Interleaved { virtual_stages: 3 },
];

fn valid(kind: ScheduleKind, p: usize, m: usize) -> bool {
    !matches!(kind, ScheduleKind::Interleaved { .. }) || m.is_multiple_of(p)
}

/// Balanced stages with t_b = 2 t_f and no latency.
fn bubble(s: &Schedule) -> f64 {
    let p = s.stages();
    match s.simulate(&vec![1.0; p], &vec![2.0; p], 0.0) {
        Ok(t) => t.bubble_fraction(),
        Err(e) => panic!("simulate failed: {e}"),
    }
}

/// 000 F41.
fn f41(p: usize, m: usize) -> f64 {
    (p - 1) as f64 / (m + p - 1) as f64
}

#[test]
fn pipeline_grid_passes_check() {
    for kind in KINDS {
        for p in 1..=8 {
            for m in 1..=16 {
                if !valid(kind, p, m) {
                    continue;
                }
                let s = Schedule::new(kind, p, m)
                    .unwrap_or_else(|e| panic!("{kind:?} p={p} m={m}: {e}"));
                assert_eq!(s.check(), Ok(()));
                let v = kind.virtual_stages();
                for stage in 0..p {
                    let list = s.actions(stage).unwrap_or_default();
                    let computes = list.iter().filter(|a| a.is_compute()).count();
                    assert_eq!(computes, 2 * m * v, "{kind:?} p={p} m={m} stage {stage}");
                    assert_eq!(list.last(), Some(&OptimizerStep));
                    let steps = list.iter().filter(|a| **a == OptimizerStep).count();
                    assert_eq!(steps, 1, "one update per m micro-batches");
                }
            }
        }
    }
}

#[test]
fn pipeline_rejects_bad_inputs() {
    let cases = [
        (ScheduleKind::OneFOneB, 0, 4, "pipeline_stages"),
        (ScheduleKind::GPipe, 2, 0, "microbatches"),
        (
            ScheduleKind::Interleaved { virtual_stages: 0 },
            2,
            4,
            "virtual_stages",
        ),
        (
            ScheduleKind::Interleaved { virtual_stages: 2 },
            4,
            6,
            "microbatches",
        ),
        (ScheduleKind::GPipe, usize::MAX, 2, "microbatches"),
    ];
    for (kind, p, m, field) in cases {
        match Schedule::new(kind, p, m) {
            Err(ScheduleError::Invalid { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{kind:?} p={p} m={m}: expected Invalid, got {other:?}"),
        }
    }
    let msg = Schedule::new(ScheduleKind::Interleaved { virtual_stages: 2 }, 4, 6)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(msg.contains("6 % 4 = 2"), "{msg}");
    // Hand-built lists are bounded too (no huge allocation from a typo).
    let big = Schedule::from_actions(ScheduleKind::GPipe, usize::MAX / 2, vec![vec![]]);
    assert!(matches!(
        big,
        Err(ScheduleError::Invalid {
            field: "microbatches",
            ..
        })
    ));
    // Surfaces as the crate's config error.
    let e: crate::TrainError = ScheduleError::Deadlock { detail: "x".into() }.into();
    assert!(e.to_string().contains("deadlock"));
}

/// p = 2, m = 2 1F1B with every message, as Algorithm 1 and the module doc's event order give:
/// stage 1 receives mb 1's activation as soon as stage 0 has it (before its backward of mb 0).
fn one_f_one_b_2x2() -> Vec<Vec<Action>> {
    vec![
        parse("F0 sA0>1 F1 sA1>1 rG0<1 B0 rG1<1 B1 step"),
        parse("rA0<0 F0 rA1<0 B0 sG0>0 F1 B1 sG1>0 step"),
    ]
}

/// Actions from their labels ([`Action::label`], one chunk per stage): `F0` forward of
/// micro-batch 0, `B0` backward, `sA0>1` / `rA0<0` send / receive its activation to / from a
/// stage, `sG0>0` / `rG0<1` the same for its gradient, `step` the optimizer step.
fn parse(line: &str) -> Vec<Action> {
    line.split_whitespace()
        .map(|w| {
            if w == "step" {
                return OptimizerStep;
            }
            let num = |s: &str| s.parse::<usize>().unwrap_or_else(|_| panic!("label {w}"));
            let (kind, rest) = w.split_at(if w.starts_with(['s', 'r']) { 2 } else { 1 });
            let (mb, peer) = match rest.split_once(['>', '<']) {
                Some((m, p)) => (num(m), num(p)),
                None => (num(rest), 0),
            };
            let chunk = 0;
            match kind {
                "F" => Forward { mb, chunk },
                "B" => Backward { mb, chunk },
                "sA" => SendActivation {
                    mb,
                    chunk,
                    to: peer,
                },
                "rA" => RecvActivation {
                    mb,
                    chunk,
                    from: peer,
                },
                "sG" => SendGrad {
                    mb,
                    chunk,
                    to: peer,
                },
                "rG" => RecvGrad {
                    mb,
                    chunk,
                    from: peer,
                },
                _ => panic!("unknown label {w}"),
            }
        })
        .collect()
}

#[test]
fn pipeline_golden_1f1b_p2_m2_with_messages() {
    let s = Schedule::new(ScheduleKind::OneFOneB, 2, 2).map_err(|e| e.to_string());
    assert_eq!(s.map(|s| s.per_stage().to_vec()), Ok(one_f_one_b_2x2()));
}

#[test]
fn pipeline_golden_1f1b_p2_m4() {
    // Algorithm 1: stage 0 warms up with p - 0 - 1 = 1 forward, alternates F/B (oldest
    // backward first), drains one backward; stage 1 (last) alternates from the start.
    let s = Schedule::new(ScheduleKind::OneFOneB, 2, 4).map_err(|e| e.to_string());
    let want = vec![
        "F0 F1 B0 F2 B1 F3 B2 B3 step".to_string(),
        "F0 B0 F1 B1 F2 B2 F3 B3 step".to_string(),
    ];
    assert_eq!(s.as_ref().map(|s| s.render(false)), Ok(want));
    let shown = s.map(|s| s.to_string()).unwrap_or_default();
    assert_eq!(
        shown,
        "stage 0: F0 F1 B0 F2 B1 F3 B2 B3 step\nstage 1: F0 B0 F1 B1 F2 B2 F3 B3 step\n"
    );
}

#[test]
fn pipeline_golden_1f1b_p4_m6_and_gpipe() {
    let s = Schedule::new(ScheduleKind::OneFOneB, 4, 6).map(|s| s.render(false));
    let want = [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 step",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5 step",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5 step",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 step",
    ];
    assert_eq!(s, Ok(want.iter().map(|l| l.to_string()).collect()));
    let g = Schedule::new(ScheduleKind::GPipe, 2, 3).map(|s| s.render(false));
    let want = ["F0 F1 F2 B0 B1 B2 step", "F0 F1 F2 B0 B1 B2 step"];
    assert_eq!(g, Ok(want.iter().map(|l| l.to_string()).collect()));
}

#[test]
fn pipeline_golden_interleaved_p2_m2_v2() {
    // Megatron order: forwards in groups of p = 2 micro-batches per chunk; stage 0 warms up
    // with 2 (p - 1) + (v - 1) p = 4 = all of its forwards, stage 1 with 2.
    let s = Schedule::new(ScheduleKind::Interleaved { virtual_stages: 2 }, 2, 2)
        .map(|s| s.render(false));
    let want = [
        "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0 step",
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0 step",
    ];
    assert_eq!(s, Ok(want.iter().map(|l| l.to_string()).collect()));
}

fn expect_action_error(lists: Vec<Vec<Action>>, stage: usize, index: usize, needle: &str) {
    match Schedule::from_actions(ScheduleKind::OneFOneB, 2, lists) {
        Err(e @ ScheduleError::Action { .. }) => {
            let msg = e.to_string();
            let ScheduleError::Action {
                stage: s, index: i, ..
            } = e
            else {
                unreachable!()
            };
            assert_eq!((s, i), (stage, index), "{msg}");
            assert!(msg.contains(needle), "{msg}");
        }
        other => panic!("expected an action error, got {other:?}"),
    }
}

#[test]
fn pipeline_catches_backward_before_forward() {
    let mut lists = one_f_one_b_2x2();
    // Stage 1: move Backward mb 0 ahead of its Forward.
    lists[1].swap(1, 3);
    expect_action_error(lists, 1, 1, "backward before its forward");
}

#[test]
fn pipeline_catches_forward_before_receive_and_early_step() {
    let mut lists = one_f_one_b_2x2();
    lists[1].swap(0, 1);
    expect_action_error(lists, 1, 0, "Forward mb 0 chunk 0");
    let mut lists = one_f_one_b_2x2();
    lists[0].swap(7, 8);
    expect_action_error(lists, 0, 7, "optimizer step before the backward of mb 1");
    let mut lists = one_f_one_b_2x2();
    lists[0][1] = parse("sA0>0")[0];
    expect_action_error(lists, 0, 1, "model chunk 1 lives on stage 1");
}

#[test]
fn pipeline_catches_mismatched_send() {
    let mut lists = one_f_one_b_2x2();
    // Stage 0 sends mb 1's activation before mb 0's; stage 1 receives mb 0's first.
    lists[0] = parse("F0 F1 sA1>1 sA0>1 rG0<1 B0 rG1<1 B1 step");
    let e = Schedule::from_actions(ScheduleKind::OneFOneB, 2, lists).err();
    match &e {
        Some(ScheduleError::Mismatch {
            from: 0,
            to: 1,
            position: 0,
            sent,
            received,
        }) => {
            assert!(sent.contains("mb 1") && received.contains("mb 0"), "{e:?}");
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    // A send nobody receives.
    let mut lists = one_f_one_b_2x2();
    lists[1].remove(2);
    let e = Schedule::from_actions(ScheduleKind::OneFOneB, 2, lists).err();
    assert!(
        matches!(e, Some(ScheduleError::Action { stage: 1, .. })),
        "{e:?}"
    );
}

#[test]
fn pipeline_catches_rendezvous_deadlock() {
    // Late receives and early sends (each receive right before its compute): with unbuffered
    // sends stage 0 blocks sending mb 1's activation while stage 1 blocks sending mb 0's
    // gradient (why the generator orders messages globally).
    let lists = vec![
        parse("F0 sA0>1 F1 sA1>1 rG0<1 B0 rG1<1 B1 step"),
        parse("rA0<0 F0 B0 sG0>0 rA1<0 F1 B1 sG1>0 step"),
    ];
    match Schedule::from_actions(ScheduleKind::OneFOneB, 2, lists) {
        Err(ScheduleError::Deadlock { detail }) => {
            assert!(detail.contains("stage 0 blocked at action 3"), "{detail}");
            assert!(detail.contains("stage 1 blocked at action 3"), "{detail}");
        }
        other => panic!("expected a deadlock, got {other:?}"),
    }
}

#[test]
fn pipeline_in_flight_bounds() {
    for p in 1..=8 {
        for m in 1..=16 {
            let ofob = Schedule::new(ScheduleKind::OneFOneB, p, m);
            let gpipe = Schedule::new(ScheduleKind::GPipe, p, m);
            let (Ok(ofob), Ok(gpipe)) = (ofob, gpipe) else {
                panic!("p={p} m={m}: generation failed");
            };
            // 000 line 2401: peak activation memory scales with p, not m.
            assert_eq!(ofob.max_in_flight(0), Some(p.min(m)), "p={p} m={m}");
            for s in 0..p {
                assert!(ofob.max_in_flight(s) <= Some(p - s), "p={p} m={m} s={s}");
                assert_eq!(gpipe.max_in_flight(s), Some(m));
            }
            assert_eq!(ofob.max_in_flight(p), None);
        }
    }
}

#[test]
fn pipeline_bubble_matches_f41() {
    for p in [2, 4] {
        for m in [4, 8, 16] {
            for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
                let s = Schedule::new(kind, p, m).unwrap_or_else(|e| panic!("{e}"));
                let got = bubble(&s);
                assert!(
                    (got - f41(p, m)).abs() < 0.05,
                    "{kind:?} p={p} m={m}: {got}"
                );
                // Exact, in fact, for balanced stages.
                assert!(
                    (got - f41(p, m)).abs() < 1e-9,
                    "{kind:?} p={p} m={m}: {got}"
                );
            }
        }
    }
    // 000 E31: p = 4, m = 8 gives 3/11.
    let s = Schedule::new(ScheduleKind::OneFOneB, 4, 8).unwrap_or_else(|e| panic!("{e}"));
    assert!((bubble(&s) - 3.0 / 11.0).abs() < 1e-9);
}

#[test]
fn pipeline_interleaved_bubble_is_smaller() {
    for p in [2, 4] {
        for m in [4, 8, 16] {
            for v in [2, 3, 4] {
                let kind = ScheduleKind::Interleaved { virtual_stages: v };
                let s = Schedule::new(kind, p, m).unwrap_or_else(|e| panic!("{e}"));
                let got = bubble(&s);
                let want = (p - 1) as f64 / (v * m + p - 1) as f64;
                assert!(
                    (got - want).abs() < 0.05,
                    "p={p} m={m} v={v}: {got} vs {want}"
                );
                assert!(got < f41(p, m), "p={p} m={m} v={v}: {got}");
            }
        }
    }
}

#[test]
fn pipeline_simulate_validates_and_models_latency() {
    let s = Schedule::new(ScheduleKind::OneFOneB, 2, 4).unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        s.simulate(&[1.0], &[2.0, 2.0], 0.0),
        Err(ScheduleError::Invalid {
            field: "fwd_time",
            ..
        })
    ));
    assert!(matches!(
        s.simulate(&[1.0, 1.0], &[2.0, f64::NAN], 0.0),
        Err(ScheduleError::Invalid {
            field: "bwd_time",
            ..
        })
    ));
    assert!(matches!(
        s.simulate(&[1.0, 1.0], &[2.0, 2.0], -1.0),
        Err(ScheduleError::Invalid {
            field: "p2p_latency",
            ..
        })
    ));
    // Makespan (m + p - 1)(t_f + t_b) = 15 without latency; each of the 2 (p - 1) = 2
    // cross-stage hops on the critical path (fill and drain) adds the latency.
    let t0 = s
        .simulate(&[1.0, 1.0], &[2.0, 2.0], 0.0)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(t0.makespan, 15.0);
    assert_eq!(t0.idle(0), 3.0);
    let t1 = s
        .simulate(&[1.0, 1.0], &[2.0, 2.0], 0.5)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(t1.makespan > t0.makespan && t1.bubble_fraction() > t0.bubble_fraction());
    // Dependencies hold on the timeline: B_mb on stage 0 starts after B_mb on stage 1 ends.
    for mb in 0..4 {
        let at = |st: usize, a: Action| {
            t1.stages[st]
                .iter()
                .find(|sp| sp.action == a)
                .map(|sp| (sp.start, sp.end))
        };
        let b0 = at(0, Backward { mb, chunk: 0 });
        let b1 = at(1, Backward { mb, chunk: 0 });
        let (Some(b0), Some(b1)) = (b0, b1) else {
            panic!("missing spans")
        };
        assert!(b0.0 >= b1.1 + 0.5);
    }
    // An unbalanced last stage dominates: the bubble grows.
    let t2 = s
        .simulate(&[1.0, 2.0], &[2.0, 4.0], 0.0)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(t2.bubble_fraction() > t0.bubble_fraction());
}

#[test]
fn pipeline_alternate_display_lists_messages() {
    let s = Schedule::new(ScheduleKind::OneFOneB, 2, 2).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        format!("{s:#}"),
        "stage 0: F0 sA0>1 F1 sA1>1 rG0<1 B0 rG1<1 B1 step\n\
         stage 1: rA0<0 F0 rA1<0 B0 sG0>0 F1 B1 sG1>0 step\n"
    );
}

#[test]
fn pipeline_interleaved_in_flight() {
    // Stage 0 holds its warm-up forwards plus one: min(2 (p - 1) + (v - 1) p + 1, v m) chunk
    // activations, each 1/v of the stage's layers: p = 4, v = 2 gives 11 chunks, 5.5
    // micro-batches' worth against 1F1B's 4 (the memory price of the smaller bubble).
    for p in 1..=8 {
        for m in (p..=16).step_by(p) {
            for v in 1..=4 {
                let kind = ScheduleKind::Interleaved { virtual_stages: v };
                let s = Schedule::new(kind, p, m).unwrap_or_else(|e| panic!("{e}"));
                let want = (2 * (p - 1) + (v - 1) * p + 1).min(v * m);
                assert_eq!(s.max_in_flight(0), Some(want), "p={p} m={m} v={v}");
            }
        }
    }
}
