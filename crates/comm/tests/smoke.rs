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
