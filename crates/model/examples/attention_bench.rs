//! Times causal GQA attention forward and backward (f32) and prints GFLOP/s
//! counting the useful causal flops (forward 2·B·H·T²·D, backward 2.5x).
//!
//! ```text
//! cargo run --release -p flotilla-model --example attention_bench -- [threads] [fq,fk,fdiag bq,bk,bdiag] [reps]
//! ```
//! The optional tile triples override `Tiles::FWD` / `Tiles::BWD` (they
//! were chosen with it). Figures are medians, and minima (the least
//! disturbed calls on a shared machine), of `reps` timed calls in each of 3
//! rounds after a warm-up round. Run the peer at the same moment, same
//! shapes and thread count (`source /root/.cache/flotilla-peers/venv/bin/activate`):
//!
//! ```text
//! import sys, time, statistics, torch, torch.nn.functional as F
//! torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
//! for H, K in [(4, 4), (6, 6), (6, 2)]:
//!     B, T, D = 8, 256, 64
//!     q = torch.randn(B, H, T, D, requires_grad=True)
//!     k = torch.randn(B, K, T, D, requires_grad=True)
//!     v = torch.randn(B, K, T, D, requires_grad=True)
//!     g = torch.randn(B, H, T, D)
//!     fw, bw = [], []
//!     for r in range(4):
//!         for _ in range(20):
//!             q.grad = k.grad = v.grad = None
//!             t0 = time.perf_counter()
//!             o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != K)
//!             t1 = time.perf_counter()
//!             o.backward(g)
//!             t2 = time.perf_counter()
//!             if r > 0: fw.append(t1 - t0); bw.append(t2 - t1)
//!     fl = 2 * B * H * T * T * D
//!     f, b = statistics.median(fw), statistics.median(bw)
//!     print(f"H={H} K={K}: fwd {f*1e3:.3f} ms ({fl/f/1e9:.1f} GFLOP/s) bwd {b*1e3:.3f} ms ({2.5*fl/b/1e9:.1f} GFLOP/s)")
//! ```
use model::Threads;
use model::kernels::attention::{Tiles, attention_bwd_tiled, attention_fwd_tiled};
use std::time::Instant;

fn parse_tiles(s: &str) -> Tiles {
    let v: Vec<usize> = s
        .split(',')
        .map(|x| x.parse().expect("tiles as q,k,diag"))
        .collect();
    assert_eq!(v.len(), 3, "tiles as q,k,diag");
    Tiles {
        q: v[0],
        k: v[1],
        diag: v[2],
    }
}

fn min(v: &[f64]) -> f64 {
    v.iter().cloned().fold(f64::INFINITY, f64::min)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads: usize = args.first().map_or(2, |s| s.parse().expect("threads"));
    let tf = args.get(1).map_or(Tiles::FWD, |s| parse_tiles(s));
    let tb = args.get(2).map_or(Tiles::BWD, |s| parse_tiles(s));
    let reps: usize = args.get(3).map_or(20, |s| s.parse().expect("reps"));
    let th = Threads::new(threads).expect("threads");
    println!("threads {threads}, fwd tiles {tf:?}, bwd tiles {tb:?}");
    for (b, t, h, k, d) in [(8, 256, 4, 4, 64), (8, 256, 6, 6, 64), (8, 256, 6, 2, 64)] {
        let n = b * t;
        let w = (h + 2 * k) * d;
        let qkv: Vec<f32> = (0..n * w)
            .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 2.0)
            .collect();
        let dout: Vec<f32> = (0..n * h * d)
            .map(|i| ((i as f32 * 0.414_213_5).fract() - 0.5) * 2.0)
            .collect();
        let mut out = vec![0f32; n * h * d];
        let mut lse = vec![0f32; b * h * t];
        let mut dqkv = vec![0f32; n * w];
        let (mut tfw, mut tbw) = (Vec::new(), Vec::new());
        for round in 0..4 {
            for _ in 0..reps {
                let t0 = Instant::now();
                attention_fwd_tiled(&th, &mut out, &mut lse, &qkv, b, t, h, k, d, tf);
                let t1 = Instant::now();
                attention_bwd_tiled(&th, &mut dqkv, &dout, &qkv, &out, &lse, b, t, h, k, d, tb);
                let t2 = Instant::now();
                if round > 0 {
                    // Round 0 warms up.
                    tfw.push((t1 - t0).as_secs_f64());
                    tbw.push((t2 - t1).as_secs_f64());
                }
            }
        }
        let flops = 2.0 * (b * h * t * t * d) as f64;
        let (fmin, bmin) = (min(&tfw), min(&tbw));
        let (f, bw) = (median(tfw), median(tbw));
        println!(
            "B={b} T={t} H={h} K={k} D={d}: fwd {:.3} ms ({:.1} GFLOP/s)  bwd {:.3} ms ({:.1} GFLOP/s)  \
             total {:.3} ms | min: fwd {:.3} ms ({:.1}) bwd {:.3} ms ({:.1}) total {:.3} ms",
            f * 1e3,
            flops / f / 1e9,
            bw * 1e3,
            2.5 * flops / bw / 1e9,
            (f + bw) * 1e3,
            fmin * 1e3,
            flops / fmin / 1e9,
            bmin * 1e3,
            2.5 * flops / bmin / 1e9,
            (fmin + bmin) * 1e3,
        );
    }
}
