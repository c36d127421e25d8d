//! Quick timing of the elementwise kernels (ns per element, 2 threads).
use model::Threads;
use model::kernels::activation::{GeluKind, gelu_bwd, gelu_fwd};
use model::kernels::loss::{cross_entropy_bwd, cross_entropy_fwd};
use std::time::Instant;

fn time(label: &str, elems: usize, mut f: impl FnMut()) {
    f();
    let mut ts: Vec<f64> = (0..9)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    ts.sort_by(f64::total_cmp);
    println!(
        "{label:<24} {:>7.3} ms {:>6.3} ns/elem",
        ts[4] * 1e3,
        ts[4] * 1e9 / elems as f64
    );
}

fn main() {
    let threads = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let th = Threads::new(threads).unwrap();
    let n = 2048 * 1536;
    let x: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 0.01).collect();
    let d: Vec<f32> = (0..n).map(|i| ((i % 77) as f32 - 38.0) * 0.01).collect();
    let mut y = vec![0f32; n];
    time("gelu_fwd erf", n, || {
        gelu_fwd(&th, &mut y, &x, GeluKind::Erf)
    });
    time("gelu_fwd tanh", n, || {
        gelu_fwd(&th, &mut y, &x, GeluKind::Tanh)
    });
    time("gelu_bwd erf", n, || {
        gelu_bwd(&th, &mut y, &x, &d, GeluKind::Erf)
    });
    let (rows, v) = (2048, 8192);
    let logits: Vec<f32> = (0..rows * v)
        .map(|i| ((i % 1013) as f32 - 500.0) * 0.003)
        .collect();
    let targets: Vec<u32> = (0..rows as u32).map(|i| i * 7 % v as u32).collect();
    let (mut losses, mut lse) = (vec![0f32; rows], vec![0f32; rows]);
    time("cross_entropy_fwd", rows * v, || {
        cross_entropy_fwd(&th, &mut losses, &mut lse, &logits, &targets, rows, v)
    });
    let mut dl = logits.clone();
    time("cross_entropy_bwd", rows * v, || {
        dl.copy_from_slice(&logits);
        cross_entropy_bwd(&th, &mut dl, &lse, &targets, rows, v, 1.0 / rows as f32)
    });
}
