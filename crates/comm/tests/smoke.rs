use comm::ReduceOp;
use comm::algo::Algo;
use comm::group::{GroupConfig, OpOptions, TransportPolicy};
use comm::local::run_threads;

#[test]
fn ring_all_reduce_tcp_and_shm() {
    for transport in [TransportPolicy::TcpOnly, TransportPolicy::Auto] {
        for size in [1, 2, 3, 4] {
            let cfg = GroupConfig {
                transport,
                ..GroupConfig::default()
            };
            let res = run_threads(size, cfg, move |g| {
                let mut v: Vec<f32> = (0..1001).map(|i| (i * (g.rank() + 1)) as f32).collect();
                g.all_reduce_with(
                    &mut v,
                    ReduceOp::Sum,
                    &OpOptions {
                        algo: Some(Algo::Ring),
                        timeout: None,
                    },
                )?;
                Ok(v)
            })
            .unwrap();
            let tri = (size * (size + 1) / 2) as f32;
            for r in res {
                let v = r.unwrap();
                assert_eq!(v[1000], 1000.0 * tri, "{transport:?} size {size}");
            }
        }
    }
}

/// A calibrated single-host group measures the cost per byte of the bandwidth-bound all-reduce
/// candidates, the double tree among them (its formula is only an upper bound), and the latency
/// of a small op with every algorithm (all-reduce, reduce-scatter, all-gather, broadcast), and
/// prices a large all-reduce with those figures, so the selector compares what each algorithm
/// did here.
#[test]
fn calibration_measures_the_double_tree_and_the_selector_prices_with_it() {
    use comm::OpKind;
    use comm::model::{LATENCY_PROBE_BYTES, predict, probe_key};
    let cfg = GroupConfig {
        transport: TransportPolicy::TcpOnly,
        calibrate: true,
        ..GroupConfig::default()
    };
    let res = run_threads(3, cfg, |g| {
        Ok((g.topology().clone(), g.explain(OpKind::AllReduce, 64 << 20)))
    })
    .unwrap();
    let n = 64 << 20;
    let mut seen = Vec::new();
    let mut latencies = Vec::new();
    for r in res {
        let (t, sel) = r.unwrap();
        for algo in [Algo::Ring, Algo::DoubleTree] {
            let key = probe_key(OpKind::AllReduce, algo);
            let k = t.per_byte[&key];
            assert!(k > 0.0 && k.is_finite(), "{algo:?}: {k}");
            let l = t.latency[&key];
            assert!(l > 0.0 && l < 1.0, "{algo:?}: latency {l}");
            let priced = l + (n - LATENCY_PROBE_BYTES) as f64 * k;
            let p = predict(OpKind::AllReduce, algo, n, &t).unwrap();
            assert!(
                (p - priced).abs() <= 1e-12 * priced,
                "{algo:?}: {p} vs {priced}"
            );
            let ranked = |a: Algo| {
                sel.candidates
                    .iter()
                    .find(|c| c.algo == a)
                    .unwrap()
                    .ranked_s
            };
            assert!(ranked(sel.algo) <= ranked(algo), "{sel}");
        }
        assert_eq!(sel.source, "model");
        // Every collective the bench times has its small-op latency measured, per algorithm.
        for op in [OpKind::ReduceScatter, OpKind::AllGather, OpKind::Broadcast] {
            let key = probe_key(op, Algo::Ring);
            assert!(
                t.latency.get(&key).is_some_and(|&l| l > 0.0 && l < 1.0),
                "{key}: {:?}",
                t.latency
            );
        }
        seen.push(sel.algo);
        latencies.push(t.latency);
    }
    // Every rank uses rank 0's figures, so all choose alike.
    assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
    assert!(latencies.windows(2).all(|w| w[0] == w[1]), "{latencies:?}");
}

/// A calibrated group spins for three of its measured rounds (within 20-100 us) unless the
/// configuration names a spin, which is kept.
#[test]
fn the_spin_follows_the_measured_round_unless_configured() {
    use comm::group::config::{DEFAULT_SPIN, MAX_SPIN, auto_spin};
    use std::time::Duration;
    let calibrated = GroupConfig {
        calibrate: true,
        ..GroupConfig::default()
    };
    for r in run_threads(3, calibrated.clone(), |g| {
        Ok((g.spin(), g.topology().round))
    })
    .unwrap()
    {
        let (spin, round) = r.unwrap();
        assert_eq!(spin, auto_spin(round));
        assert!((DEFAULT_SPIN..=MAX_SPIN).contains(&spin), "{spin:?}");
    }
    let fixed = GroupConfig {
        spin: Some(Duration::ZERO),
        ..calibrated
    };
    for r in run_threads(3, fixed, |g| Ok(g.spin())).unwrap() {
        assert_eq!(r.unwrap(), Duration::ZERO);
    }
}
