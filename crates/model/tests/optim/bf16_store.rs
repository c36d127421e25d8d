//! bf16 storage of parameters and gradients with f32 master weights.
use super::shape_what;
use half::bf16;
use model::Threads;
use model::optim::bf16::to_bf16;
use model::optim::{AdamW, AdamWConfig, Bf16Store, Schedule};

#[test]
fn bf16_grads_round_trip_and_round_to_nearest_even() {
    let mut s = Bf16Store::new(vec![0.0; 6]);
    assert_eq!(
        (s.param_bytes(), s.grad_bytes(), s.master_bytes()),
        (12, 12, 24)
    );
    // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: rounds to the even (1.0);
    // 1 + 3*2^-8 ties between 1 + 2^-7 and 1 + 2^-6: rounds to 1 + 2^-6.
    let ulp = 2f32.powi(-7);
    let src = [
        1.5,
        -0.25,
        1.0 + ulp / 2.0,
        1.0 + 1.5 * ulp,
        1.0 + ulp / 2.0 + 1e-6,
        3.0e38,
    ];
    s.store_grads(&src).unwrap();
    let mut back = vec![0.0; 6];
    s.decode_grads(&mut back).unwrap();
    assert_eq!(&back[..5], &[1.5, -0.25, 1.0, 1.0 + 2.0 * ulp, 1.0 + ulp]);
    assert_eq!(back[5], bf16::from_f32(3.0e38).to_f32());
    // Values representable in bf16 round-trip exactly.
    let exact: Vec<f32> = (0..6)
        .map(|i| bf16::from_bits(0x3f80 + 3 * i as u16).to_f32())
        .collect();
    s.store_grads(&exact).unwrap();
    s.decode_grads(&mut back).unwrap();
    assert_eq!(back, exact);

    assert_eq!(
        shape_what(s.store_grads(&[1.0]).unwrap_err()),
        "bf16 grads source"
    );
    assert_eq!(
        shape_what(s.decode_params(&mut [0.0; 2]).unwrap_err()),
        "bf16 decoded params"
    );
}

#[test]
fn bf16_rounding_matches_half() {
    // Checked exhaustively over all 2^32 patterns once; here a sample plus
    // the edges (ties, overflow to infinity, NaNs, subnormals, signed zeros).
    let edges = [
        0u32,
        0x8000_0000,
        0x3F80_8000,
        0x3F81_8000,
        0x3F80_8001,
        0x7F7F_FFFF,
        0x7F7F_8000,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001,
        0x7FC0_0000,
        0xFFFF_FFFF,
        0x0000_8000,
        0x0001_8000,
        0x807F_FFFF,
    ];
    let sample = (0..=u32::MAX).step_by(65_521).chain(edges);
    for b in sample {
        let x = f32::from_bits(b);
        assert_eq!(
            to_bf16(x).to_bits(),
            bf16::from_f32(x).to_bits(),
            "{b:#010x}"
        );
    }
}

#[test]
fn bf16_step_matches_f32_adamw_on_decoded_grads() {
    let len = 40_000;
    let master: Vec<f32> = (0..len)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let decay = [0..1000, 20_000..len];
    let c = AdamWConfig::default();
    let th = Threads::new(2).unwrap();
    let mut s = Bf16Store::new(master.clone());
    let mut opt = AdamW::new(c, len).unwrap();
    let mut reference = master;
    let mut ref_opt = AdamW::new(c, len).unwrap();
    let mut decoded = vec![0.0; len];
    for step in 0..3u64 {
        let g: Vec<f32> = (0..len)
            .map(|i| (((i as u64 * 31 + step * 7) % 17) as f32 - 8.0) / 7.0)
            .collect();
        s.store_grads(&g).unwrap();
        s.decode_grads(&mut decoded).unwrap();
        s.step(&th, &mut opt, 1e-2, &decay).unwrap();
        ref_opt
            .step(&Threads::single(), &mut reference, &decoded, 1e-2, &decay)
            .unwrap();
        assert_eq!(s.master(), &reference[..]);
        assert!(
            s.params()
                .iter()
                .zip(s.master())
                .all(|(p, &m)| p.to_bits() == bf16::from_f32(m).to_bits())
        );
    }
    s.decode_params(&mut decoded).unwrap();
    assert!(
        decoded
            .iter()
            .zip(s.master())
            .all(|(&d, &m)| (d - m).abs() <= m.abs() / 256.0)
    );

    let mut small = AdamW::new(c, 3).unwrap();
    assert_eq!(
        shape_what(s.step(&th, &mut small, 1e-2, &[]).unwrap_err()),
        "bf16 store vs adamw state"
    );
}

#[test]
fn bf16_quadratic_converges() {
    // Minimise sum_i (x_i - t_i)^2 computing gradients from the bf16 params.
    let target: Vec<f32> = (0..256).map(|i| (i as f32 - 128.0) / 37.0).collect();
    let th = Threads::single();
    let mut s = Bf16Store::new(vec![0.0; target.len()]);
    let mut opt = AdamW::new(
        AdamWConfig {
            weight_decay: 0.0,
            ..AdamWConfig::default()
        },
        target.len(),
    )
    .unwrap();
    let sched = Schedule::Cosine {
        warmup: 20,
        total: 600,
        min_lr_ratio: 0.01,
    };
    let mut x = vec![0.0f32; target.len()];
    let mut g = vec![0.0f32; target.len()];
    for step in 0..600 {
        s.decode_params(&mut x).unwrap();
        for ((gi, xi), ti) in g.iter_mut().zip(&x).zip(&target) {
            *gi = 2.0 * (xi - ti);
        }
        s.store_grads(&g).unwrap();
        s.step(&th, &mut opt, sched.lr_at(0.05, step), &[]).unwrap();
    }
    for (i, (&m, &t)) in s.master().iter().zip(&target).enumerate() {
        // Within bf16 resolution of the target.
        assert!(
            (m - t).abs() <= t.abs() / 64.0 + 1e-3,
            "element {i}: {m} vs {t}"
        );
    }
}
