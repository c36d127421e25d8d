//! Correctness of every op x algorithm x dtype over group sizes 1..=8 (including non-powers of
//! two), empty and odd-length buffers, on TCP and on shared memory, against a reference computed
//! on one rank from the same closed-form inputs. Every rank's output must also be bit-identical.

use comm::algo::Algo;
use comm::group::{GroupConfig, OpOptions, ProcessGroup, TransportPolicy};
use comm::local::run_threads;
use comm::{DType, Element, OpKind, ReduceOp};
use half::{bf16, f16};
use std::fmt::Debug;

/// Test-side helpers per element type.
trait TElem: Element + PartialEq + Debug {
    fn small(v: u8) -> Self;
}
macro_rules! telem {
    ($t:ty, $e:expr) => {
        impl TElem for $t {
            fn small(v: u8) -> Self {
                let f: fn(u8) -> $t = $e;
                f(v)
            }
        }
    };
}
telem!(f32, |v| v as f32);
telem!(f64, |v| v as f64);
telem!(i32, |v| v as i32);
telem!(i64, |v| v as i64);
telem!(u8, |v| v);
telem!(bf16, |v| bf16::from_f32(v as f32));
telem!(f16, |v| f16::from_f32(v as f32));

/// Input element i of rank r: small integers, so every reduction order gives exact results.
/// Half types use {1, 2} so that products stay exactly representable.
fn val<T: TElem>(r: usize, i: usize) -> T {
    match T::DTYPE {
        DType::BF16 | DType::F16 => T::small(1 + ((r * 7 + i * 3) % 2) as u8),
        _ => T::small(1 + ((r * 7 + i * 3) % 5) as u8),
    }
}

fn input<T: TElem>(r: usize, n: usize) -> Vec<T> {
    (0..n).map(|i| val(r, i)).collect()
}

fn reduced<T: TElem>(p: usize, n: usize, op: ReduceOp) -> Vec<T> {
    (0..n)
        .map(|i| {
            let mut acc = val::<T>(0, i);
            for r in 1..p {
                acc = T::combine(acc, val(r, i), op);
            }
            if op == ReduceOp::Avg {
                acc.div_count(p)
            } else {
                acc
            }
        })
        .collect()
}

fn algos_for(op: OpKind, transport: TransportPolicy) -> Vec<Algo> {
    Algo::ALL
        .into_iter()
        .filter(|a| a.serves(op) && *a != Algo::Hierarchical)
        .filter(|a| *a != Algo::DirectRead || transport == TransportPolicy::Auto)
        .collect()
}

fn opts(algo: Algo) -> OpOptions {
    OpOptions {
        algo: Some(algo),
        timeout: None,
    }
}

const SIZES: [usize; 4] = [0, 1, 7, 1001];

/// Runs every op and algorithm for element type T on one group; returns outputs for the
/// cross-rank identity check.
fn sweep<T: TElem>(
    g: &ProcessGroup,
    transport: TransportPolicy,
    reduce_ops: &[ReduceOp],
) -> Vec<Vec<T>> {
    let (r, p) = (g.rank(), g.size());
    let mut outs = Vec::new();
    for &n in &SIZES {
        for algo in algos_for(OpKind::AllReduce, transport) {
            for &op in reduce_ops {
                let mut b = input::<T>(r, n);
                g.all_reduce_with(&mut b, op, &opts(algo)).unwrap();
                assert_eq!(
                    b,
                    reduced::<T>(p, n, op),
                    "all_reduce {algo:?} {op:?} n={n} p={p} rank {r}"
                );
                outs.push(b);
            }
        }
        for algo in algos_for(OpKind::ReduceScatter, transport) {
            for &op in reduce_ops {
                let inp = input::<T>(r, n * p);
                let mut out = vec![T::small(0); n];
                g.reduce_scatter_with(&inp, &mut out, op, &opts(algo))
                    .unwrap();
                assert_eq!(
                    out,
                    reduced::<T>(p, n * p, op)[r * n..(r + 1) * n],
                    "reduce_scatter {algo:?} {op:?} n={n} p={p}"
                );
            }
        }
        // Variable sizes: rank q contributes n + q % 2 elements.
        let counts: Vec<usize> = (0..p).map(|q| n + q % 2).collect();
        let expect: Vec<T> = (0..p).flat_map(|q| input::<T>(q, counts[q])).collect();
        for algo in algos_for(OpKind::AllGather, transport) {
            let mut out = vec![T::small(0); expect.len()];
            g.all_gather_v_with(&input::<T>(r, counts[r]), &mut out, &counts, &opts(algo))
                .unwrap();
            assert_eq!(out, expect, "all_gather_v {algo:?} n={n} p={p}");
        }
        let root = p / 2;
        for algo in algos_for(OpKind::Broadcast, transport) {
            let mut b = if r == root {
                input::<T>(100, n)
            } else {
                vec![T::small(0); n]
            };
            g.broadcast_bytes(
                comm::dtype::as_bytes_mut(&mut b),
                T::DTYPE,
                root,
                &opts(algo),
            )
            .unwrap();
            assert_eq!(b, input::<T>(100, n), "broadcast {algo:?} n={n} p={p}");
        }
        for algo in algos_for(OpKind::Reduce, transport) {
            let op = reduce_ops[0];
            let mut b = input::<T>(r, n);
            g.reduce_bytes(
                comm::dtype::as_bytes_mut(&mut b),
                T::DTYPE,
                root,
                op,
                &opts(algo),
            )
            .unwrap();
            let want = if r == root {
                reduced::<T>(p, n, op)
            } else {
                input::<T>(r, n)
            };
            assert_eq!(b, want, "reduce {algo:?} n={n} p={p} rank {r}");
        }
        // All-to-all, equal and variable blocks: rank q sends (q + j + n) % 3 elements to j.
        let send: Vec<usize> = (0..p).map(|j| (r + j + n) % 3).collect();
        let recv: Vec<usize> = (0..p).map(|j| (j + r + n) % 3).collect();
        let inp: Vec<T> = (0..p)
            .flat_map(|j| input::<T>(r * 10 + j, send[j]))
            .collect();
        let want: Vec<T> = (0..p)
            .flat_map(|j| input::<T>(j * 10 + r, recv[j]))
            .collect();
        for algo in algos_for(OpKind::AllToAll, transport) {
            let mut out = vec![T::small(0); want.len()];
            g.all_to_all_v_with(&inp, &send, &mut out, &recv, &opts(algo))
                .unwrap();
            assert_eq!(out, want, "all_to_all_v {algo:?} n={n} p={p}");
            let eq_in: Vec<T> = input(r, n * p);
            let mut eq_out = vec![T::small(0); n * p];
            g.all_to_all(&eq_in, &mut eq_out).unwrap();
            let eq_want: Vec<T> = (0..p)
                .flat_map(|j| input::<T>(j, n * p)[r * n..(r + 1) * n].to_vec())
                .collect();
            assert_eq!(eq_out, eq_want, "all_to_all n={n} p={p}");
        }
    }
    g.barrier().unwrap();
    outs
}

fn bytes<T: TElem>(v: Vec<Vec<T>>) -> Vec<Vec<u8>> {
    v.into_iter()
        .map(|x| comm::dtype::as_bytes(&x).to_vec())
        .collect()
}

fn run_all_dtypes(g: &ProcessGroup, t: TransportPolicy) -> Vec<Vec<u8>> {
    use ReduceOp::*;
    let mut all = bytes(sweep::<f32>(g, t, &ReduceOp::ALL));
    all.extend(bytes(sweep::<i32>(g, t, &ReduceOp::ALL)));
    all.extend(bytes(sweep::<f64>(g, t, &[Sum, Min])));
    all.extend(bytes(sweep::<i64>(g, t, &[Max, Avg])));
    all.extend(bytes(sweep::<u8>(g, t, &[Sum, Prod])));
    all.extend(bytes(sweep::<bf16>(g, t, &[Sum, Prod])));
    all.extend(bytes(sweep::<f16>(g, t, &[Avg, Max])));
    all
}

fn check_transport(t: TransportPolicy) {
    for size in 1..=8 {
        let cfg = GroupConfig {
            transport: t,
            ..GroupConfig::default()
        };
        let res = run_threads(size, cfg, move |g| Ok(run_all_dtypes(&g, t))).unwrap();
        let res: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
        // 4 sizes x (5 algorithms (+direct_read on shm)) x (5+5+2+2+2+2+2 reduce ops).
        let algos = algos_for(OpKind::AllReduce, t).len();
        assert_eq!(
            res[0].len(),
            SIZES.len() * algos * 20,
            "{t:?} size {size}: not every case ran"
        );
        for r in 1..size {
            assert!(
                res[r] == res[0],
                "{t:?} size {size}: rank {r}'s all-reduce bytes differ from rank 0's"
            );
        }
    }
}

#[test]
fn every_op_algorithm_dtype_over_tcp() {
    check_transport(TransportPolicy::TcpOnly);
}

#[test]
fn every_op_algorithm_dtype_over_shared_memory() {
    check_transport(TransportPolicy::Auto);
}

#[test]
fn send_recv_ring_and_bit_identical_float_sums() {
    let res = run_threads(5, GroupConfig::default(), |g| {
        let (r, p) = (g.rank(), g.size());
        let msg: Vec<f64> = (0..333).map(|i| (r * 1000 + i) as f64).collect();
        let mut got = vec![0f64; 333];
        let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
        if r % 2 == 0 {
            g.send(&msg, next)?;
            g.recv(&mut got, prev)?;
        } else {
            g.recv(&mut got, prev)?;
            g.send(&msg, next)?;
        }
        assert_eq!(got[5], (prev * 1000 + 5) as f64);
        // Non-integer sums: order matters, so identical bytes on every rank prove a fixed order.
        let mut outs = Vec::new();
        for algo in algos_for(OpKind::AllReduce, TransportPolicy::Auto) {
            let mut v: Vec<f32> = (0..5000)
                .map(|i| ((r + 1) as f32 * 0.1 + i as f32 * 1e-3).sin())
                .collect();
            g.all_reduce_with(&mut v, ReduceOp::Sum, &opts(algo))?;
            outs.push(v);
        }
        Ok(outs)
    })
    .unwrap();
    let res: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
    for r in 1..res.len() {
        assert!(res[r] == res[0], "rank {r} differs");
    }
}
