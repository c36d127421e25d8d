//! Global gradient-norm clipping and the finiteness checks.
use super::optim_field;
use model::ModelError;
use model::Threads;
use model::optim::{check_finite, check_max_norm, clip_grad_norm, grad_norm};

#[test]
fn grad_norm_of_known_vectors() {
    let th = Threads::single();
    assert_eq!(grad_norm(&th, &[3.0, 4.0]), 5.0);
    assert_eq!(grad_norm(&th, &[]), 0.0);
    assert_eq!(grad_norm(&th, &[2.0; 9]), 6.0); // sqrt(9 * 4), one odd-length tail
    // Many blocks: n copies of 0.5 have norm 0.5 * sqrt(n).
    let n = 1 << 20;
    let g = vec![0.5f32; n];
    assert_eq!(grad_norm(&Threads::new(2).unwrap(), &g), 512.0);
}

#[test]
fn grad_norm_is_deterministic_across_threads() {
    let g: Vec<f32> = (0..200_001u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) >> 8) as f32 / 16_777_216.0) - 0.5)
        .collect();
    let n1 = grad_norm(&Threads::single(), &g);
    let n2 = grad_norm(&Threads::new(2).unwrap(), &g);
    let n3 = grad_norm(&Threads::new(3).unwrap(), &g);
    assert_eq!(n1.to_bits(), n2.to_bits());
    assert_eq!(n1.to_bits(), n3.to_bits());
    let naive = g
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    assert!((n1 - naive).abs() <= 1e-12 * naive);
}

#[test]
fn clipping_scales_to_max_norm() {
    let th = Threads::single();
    let mut g = vec![3.0f32, 4.0];
    let before = clip_grad_norm(&th, &mut g, 1.0);
    assert_eq!(before, 5.0);
    let c = (1.0 / (5.0 + 1e-6)) as f32;
    assert_eq!(g, vec![3.0 * c, 4.0 * c]);
    assert!((grad_norm(&th, &g) - 1.0).abs() < 1e-6);

    // Below the threshold: untouched.
    let mut g = vec![3.0f32, 4.0];
    assert_eq!(clip_grad_norm(&th, &mut g, 10.0), 5.0);
    assert_eq!(g, vec![3.0, 4.0]);

    // Large, over threads.
    let th2 = Threads::new(2).unwrap();
    let mut g: Vec<f32> = (0..70_000).map(|i| (i % 13) as f32 - 6.0).collect();
    let before = clip_grad_norm(&th2, &mut g, 2.5);
    assert!(before > 2.5);
    assert!((grad_norm(&th2, &g) - 2.5).abs() < 1e-5);

    // Non-finite gradients: reported, not spread.
    let mut g = vec![1.0f32, f32::NAN, 2.0];
    let n = clip_grad_norm(&th, &mut g, 1.0);
    assert!(n.is_nan());
    assert_eq!(g[0], 1.0);
    assert_eq!(g[2], 2.0);
}

#[test]
fn finiteness_and_threshold_checks() {
    assert!(check_finite("loss", 3, 2.5).is_ok());
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        match check_finite("grad norm", 17, bad).unwrap_err() {
            ModelError::NonFinite { what, step, value } => {
                assert_eq!((what, step), ("grad norm", 17));
                assert_eq!(value.to_bits(), bad.to_bits());
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert!(check_max_norm(1.0).is_ok());
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(
            optim_field(check_max_norm(bad).unwrap_err()),
            "max_grad_norm"
        );
    }
}
