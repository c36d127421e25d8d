//! AdamW against PyTorch's reference values, across threads, and its errors.
use super::reference::*;
use super::{optim_field, shape_what};
use model::ModelError;
use model::Threads;
use model::optim::{AdamW, AdamWConfig};
use std::ops::Range;

const N: usize = 32;
const STEPS: u64 = 3;

/// A 24-bit integer from element index `j` and `step` (as in the script).
fn mix(j: usize, step: u64) -> u64 {
    ((j as u64 * 2_654_435_761 + step * 40_503) % (1 << 32)) >> 8
}

/// Initial parameter of flat element `j` (as in the script).
fn param0(j: usize) -> f32 {
    let mag = ((1 << 22) + mix(j, 0) % (3 << 22)) as f32 / (1 << 24) as f32;
    if j.is_multiple_of(3) { -mag } else { mag }
}

/// Gradient of flat element `j` at 1-based `step` (as in the script).
fn grad(j: usize, step: u64) -> f32 {
    (mix(j, step) as i64 - (1 << 23)) as f32 / (1 << 23) as f32 / (1u32 << (j % 12)) as f32
}

/// Run `STEPS` AdamW steps on `blocks * N` elements; return the parameters
/// and the optimizer.
fn run_adamw(
    th: &Threads,
    blocks: usize,
    lr: f32,
    cfg: AdamWConfig,
    decay: &[Range<usize>],
) -> (Vec<f32>, AdamW) {
    let len = blocks * N;
    let mut p: Vec<f32> = (0..len).map(param0).collect();
    let mut opt = AdamW::new(cfg, len).unwrap();
    for step in 1..=STEPS {
        let g: Vec<f32> = (0..len).map(|j| grad(j, step)).collect();
        opt.step(th, &mut p, &g, lr, decay).unwrap();
    }
    assert_eq!(opt.step_count(), STEPS);
    (p, opt)
}

/// `|a - b| <= 2e-7 * max(|a|, |b|)` elementwise (about one f32 ulp).
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let diff = (f64::from(g) - f64::from(w)).abs();
        let scale = f64::from(g.abs().max(w.abs()));
        assert!(diff <= 2e-7 * scale, "{what}[{i}]: got {g:e}, want {w:e}");
    }
}

/// Bitwise equality, reporting the first difference.
fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}[{i}]: got {g:e}, want {w:e}"
        );
    }
}

/// Compare a run with a case of the script.
fn check_case(got: &(Vec<f32>, AdamW), p: &[f32], m: &[f32], v: &[f32], what: &str) {
    assert_close(&got.0, p, what);
    let (gm, gv) = got.1.moments();
    assert_bits(gm, m, what);
    assert_bits(gv, v, what);
}

fn cfg(beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> AdamWConfig {
    AdamWConfig {
        beta1,
        beta2,
        eps,
        weight_decay,
    }
}

#[test]
fn adamw_matches_torch_defaults() {
    let th = Threads::single();
    assert_eq!(AdamWConfig::default(), cfg(0.9, 0.999, 1e-8, 0.01));
    let r = run_adamw(
        &th,
        1,
        1e-3,
        AdamWConfig::default(),
        std::slice::from_ref(&(0..N)),
    );
    check_case(&r, &DEFAULTS_P, &DEFAULTS_M, &DEFAULTS_V, "defaults");
}

#[test]
fn adamw_matches_torch_without_decay() {
    let th = Threads::single();
    let r = run_adamw(
        &th,
        1,
        1e-2,
        cfg(0.8, 0.99, 1e-6, 0.0),
        std::slice::from_ref(&(0..N)),
    );
    check_case(
        &r,
        &NO_DECAY_P,
        &NO_DECAY_M,
        &NO_DECAY_V,
        "no decay (wd = 0)",
    );
    // Weight decay > 0 but no decay ranges: the same result.
    let r = run_adamw(&th, 1, 1e-2, cfg(0.8, 0.99, 1e-6, 0.3), &[]);
    check_case(
        &r,
        &NO_DECAY_P,
        &NO_DECAY_M,
        &NO_DECAY_V,
        "no decay (no ranges)",
    );
}

#[test]
fn adamw_matches_torch_with_decay_mask() {
    let c = cfg(0.9, 0.95, 1e-8, 0.1);
    for n in [1, 2] {
        let th = Threads::new(n).unwrap();
        let r = run_adamw(&th, 3, 2e-2, c, &[0..N, 2 * N..3 * N]);
        check_case(&r, &MASKED_P, &MASKED_M, &MASKED_V, "masked");
        // Order and overlap of the ranges do not matter.
        let q = run_adamw(
            &th,
            3,
            2e-2,
            c,
            &[2 * N..3 * N, 0..10, 5..N, 2 * N + 3..2 * N + 9],
        );
        assert_eq!(r.0, q.0);
    }
}

#[test]
fn adamw_matches_torch_low_beta1() {
    let th = Threads::single();
    let r = run_adamw(
        &th,
        1,
        5e-3,
        cfg(0.3, 0.5, 1e-8, 0.05),
        std::slice::from_ref(&(0..N)),
    );
    check_case(&r, &LOW_BETA1_P, &LOW_BETA1_M, &LOW_BETA1_V, "low beta1");
}

#[test]
fn adamw_is_elementwise_across_threads_and_restores_state() {
    // Large enough to be split over threads.
    let len = 100_003;
    let p0: Vec<f32> = (0..len)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let g: Vec<f32> = (0..len)
        .map(|i| ((i * 104_729) % 997) as f32 / 997.0 - 0.5)
        .collect();
    let decay = [10..50_000, 70_000..len];
    let c = AdamWConfig::default();
    let run = |th: &Threads, steps: u64, start: Option<AdamW>| {
        let mut p = p0.clone();
        let mut opt = start.unwrap_or_else(|| AdamW::new(c, len).unwrap());
        for _ in 0..steps {
            opt.step(th, &mut p, &g, 3e-3, &decay).unwrap();
        }
        (p, opt)
    };
    let (p1, o1) = run(&Threads::single(), 2, None);
    let (p2, o2) = run(&Threads::new(2).unwrap(), 2, None);
    assert_eq!(p1, p2);
    assert_eq!(o1.moments(), o2.moments());

    // Checkpoint round trip: continuing from restored state equals continuing.
    let (m, v) = o1.moments();
    let restored = AdamW::from_state(c, m.to_vec(), v.to_vec(), o1.step_count()).unwrap();
    let mut pa = p1.clone();
    let mut oa = o1.clone();
    oa.step(&Threads::single(), &mut pa, &g, 3e-3, &decay)
        .unwrap();
    let mut pb = p1;
    let mut ob = restored;
    ob.step(&Threads::single(), &mut pb, &g, 3e-3, &decay)
        .unwrap();
    assert_eq!(pa, pb);
    assert_eq!(ob.step_count(), 3);
}

#[test]
fn adamw_config_errors_name_the_field() {
    let d = AdamWConfig::default();
    let cases = [
        (AdamWConfig { beta1: 1.0, ..d }, "beta1"),
        (AdamWConfig { beta1: -0.1, ..d }, "beta1"),
        (
            AdamWConfig {
                beta2: f64::NAN,
                ..d
            },
            "beta2",
        ),
        (AdamWConfig { eps: 0.0, ..d }, "eps"),
        (
            AdamWConfig {
                eps: f64::INFINITY,
                ..d
            },
            "eps",
        ),
        (
            AdamWConfig {
                weight_decay: -1e-3,
                ..d
            },
            "weight_decay",
        ),
    ];
    for (c, field) in cases {
        assert_eq!(optim_field(c.validate().unwrap_err()), field);
        assert_eq!(optim_field(AdamW::new(c, 4).unwrap_err()), field);
    }
    let msg = AdamWConfig { eps: -1.0, ..d }
        .validate()
        .unwrap_err()
        .to_string();
    assert!(msg.contains("eps") && msg.contains("-1"), "{msg}");
    assert!(
        AdamWConfig {
            beta1: 0.0,
            beta2: 0.0,
            weight_decay: 0.0,
            ..d
        }
        .validate()
        .is_ok()
    );
}

#[test]
fn adamw_step_errors_name_the_buffer_and_change_nothing() {
    let th = Threads::single();
    let mut opt = AdamW::new(AdamWConfig::default(), 4).unwrap();
    let mut p = vec![1.0f32; 4];
    let g = vec![0.5f32; 4];
    assert_eq!(
        shape_what(opt.step(&th, &mut p[..3], &g, 1e-3, &[]).unwrap_err()),
        "adamw params"
    );
    assert_eq!(
        shape_what(opt.step(&th, &mut p, &g[..2], 1e-3, &[]).unwrap_err()),
        "adamw grads"
    );
    assert_eq!(
        optim_field(
            opt.step(&th, &mut p, &g, 1e-3, std::slice::from_ref(&(2..5)))
                .unwrap_err()
        ),
        "decay"
    );
    assert_eq!(
        optim_field(opt.step(&th, &mut p, &g, f32::NAN, &[]).unwrap_err()),
        "lr"
    );
    assert_eq!(
        optim_field(opt.step(&th, &mut p, &g, -1e-3, &[]).unwrap_err()),
        "lr"
    );
    assert_eq!(opt.step_count(), 0);
    assert_eq!(p, vec![1.0; 4]);
    assert_eq!(opt.moments().0, &[0.0; 4]);

    let c = AdamWConfig::default();
    assert_eq!(
        shape_what(AdamW::from_state(c, vec![0.0; 3], vec![0.0; 2], 1).unwrap_err()),
        "adamw second moment"
    );
    assert!(matches!(
        AdamW::from_state(c, vec![f32::NAN], vec![0.0], 7).unwrap_err(),
        ModelError::NonFinite { step: 7, .. }
    ));
    assert!(AdamW::from_state(c, vec![0.0], vec![-1.0], 1).is_err());
    assert!(AdamW::from_state(AdamWConfig { beta2: 1.5, ..c }, vec![], vec![], 0).is_err());
}
