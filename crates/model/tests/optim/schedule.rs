//! Learning-rate schedules.
use super::optim_field;
use model::optim::Schedule;

#[test]
fn constant_schedule() {
    let s = Schedule::parse("constant", 100, 1000, 0.1).unwrap();
    assert_eq!(s, Schedule::Constant);
    for step in [0, 1, 100, 10_000] {
        assert_eq!(s.lr_at(6e-4, step), 6e-4);
    }
}

#[test]
fn linear_schedule_points() {
    let s = Schedule::parse("linear", 10, 110, 0.1).unwrap();
    assert_eq!(
        s,
        Schedule::Linear {
            warmup: 10,
            total: 110,
            min_lr_ratio: 0.1
        }
    );
    assert_eq!(s.lr_at(2.0, 0), 0.0);
    assert_eq!(s.lr_at(2.0, 5), 1.0);
    assert_eq!(s.lr_at(2.0, 10), 2.0);
    assert_eq!(s.lr_at(2.0, 60), 1.1); // 2 * (0.1 + 0.9 * 0.5)
    assert_eq!(s.lr_at(2.0, 85), (2.0 * (0.1 + 0.9 * 0.25)) as f32);
    assert_eq!(s.lr_at(2.0, 110), 0.2);
    assert_eq!(s.lr_at(2.0, 1_000_000), 0.2);
    // Monotone after warmup.
    assert!((10..110).all(|t| s.lr_at(2.0, t + 1) <= s.lr_at(2.0, t)));
}

#[test]
fn cosine_schedule_points() {
    let s = Schedule::parse("cosine", 100, 1100, 0.0).unwrap();
    assert_eq!(s.lr_at(1e-3, 0), 0.0);
    assert_eq!(s.lr_at(1e-3, 50), 5e-4);
    assert_eq!(s.lr_at(1e-3, 100), 1e-3);
    assert_eq!(s.lr_at(1e-3, 600), 5e-4); // half way: cos(pi/2) = 0
    let quarter = (1e-3f32 as f64 * 0.5 * (1.0 + std::f64::consts::FRAC_1_SQRT_2)) as f32;
    assert_eq!(s.lr_at(1e-3, 350), quarter);
    assert_eq!(s.lr_at(1e-3, 1100), 0.0);
    assert_eq!(s.lr_at(1e-3, 5000), 0.0);

    let s = Schedule::Cosine {
        warmup: 0,
        total: 100,
        min_lr_ratio: 0.1,
    };
    assert_eq!(s.lr_at(1.0, 0), 1.0);
    assert_eq!(s.lr_at(1.0, 50), 0.55);
    assert_eq!(s.lr_at(1.0, 100), 0.1);
    // warmup == total: warmup, then the minimum.
    let s = Schedule::Linear {
        warmup: 4,
        total: 4,
        min_lr_ratio: 0.5,
    };
    assert_eq!(s.lr_at(1.0, 2), 0.5);
    assert_eq!(s.lr_at(1.0, 4), 0.5);
}

#[test]
fn schedule_errors() {
    let e = Schedule::parse("cosinus", 0, 10, 0.0).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("constant") && msg.contains("linear") && msg.contains("cosine"),
        "{msg}"
    );
    assert_eq!(optim_field(e), "schedule");
    assert_eq!(
        optim_field(Schedule::parse("linear", 11, 10, 0.0).unwrap_err()),
        "warmup"
    );
    assert_eq!(
        optim_field(Schedule::parse("cosine", 0, 10, 1.5).unwrap_err()),
        "min_lr_ratio"
    );
    assert_eq!(
        optim_field(Schedule::parse("cosine", 0, 10, f64::NAN).unwrap_err()),
        "min_lr_ratio"
    );
    assert!(
        Schedule::Linear {
            warmup: 1,
            total: 0,
            min_lr_ratio: 0.0
        }
        .validate()
        .is_err()
    );
}
