//! Test harness for the algorithm modules: p ranks as threads of one process over real TCP
//! loopback links (a full mesh of [`TcpLink`]s), plus input generators, a reference reduction
//! and sweeps shared by every algorithm's tests (gloo's `spawn` and its closed-form checks).
//!
//! Inputs are small integers (|x| ≤ 11), so f32, bf16 and integer sums are exact whatever the
//! order of reduction and the reference, computed on one thread in member order, is the exact
//! answer; bit-identity across ranks is asserted separately.

use super::{Ctx, Team, partition};
use crate::dtype::{DType, ReduceOp, reduce_into};
use crate::engine::OpCtx;
use crate::error::{OpDesc, Result};
use crate::frame::OpKind;
use crate::transport::Link;
use crate::transport::tcp::TcpLink;
use half::{bf16, f16};
use std::net::{TcpListener, TcpStream};
use std::ops::Range;
use std::time::{Duration, Instant};

/// Deadline of each case: long enough for a loaded 2-core machine, short enough that a hang
/// fails the test quickly.
const CASE_TIMEOUT: Duration = Duration::from_secs(10);

/// Dtypes of the all-reduce sweeps (bf16 is only summed).
pub(crate) const ALL_REDUCE_DTYPES: &[DType] = &[DType::F32, DType::I64, DType::BF16];

/// Dtypes and operators of the other sweeps.
const DTYPES: &[DType] = &[DType::F32, DType::I64];
const OPS: &[ReduceOp] = &[ReduceOp::Sum, ReduceOp::Max];

type Links = Vec<Option<Box<dyn Link>>>;

/// A full mesh of TCP loopback links: entry `[i][j]` is rank i's link to rank j.
#[allow(clippy::needless_range_loop)] // both [i][j] and [j][i] are filled
pub(crate) fn mesh(p: usize) -> Vec<Links> {
    let mut links: Vec<Links> = (0..p).map(|_| (0..p).map(|_| None).collect()).collect();
    for i in 0..p {
        for j in i + 1..p {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
            let a =
                TcpStream::connect(listener.local_addr().expect("local addr")).expect("connect");
            let (b, _) = listener.accept().expect("accept");
            links[i][j] = Some(Box::new(TcpLink::new(a).expect("tcp link")));
            links[j][i] = Some(Box::new(TcpLink::new(b).expect("tcp link")));
        }
    }
    links
}

/// Runs `f(rank, ctx)` for every rank of a fresh p-rank mesh, one thread each; results in rank
/// order. The op context starts as an f32 all-reduce; use [`begin`] to change dtype per case.
pub(crate) fn run_ranks<T: Send>(p: usize, f: impl Fn(usize, &mut Ctx<'_>) -> T + Sync) -> Vec<T> {
    let meshes = mesh(p);
    std::thread::scope(|s| {
        let handles: Vec<_> = meshes
            .into_iter()
            .enumerate()
            .map(|(rank, mut links)| {
                let f = &f;
                s.spawn(move || {
                    let desc = OpDesc {
                        group: "test".into(),
                        kind: "test",
                        seq: 0,
                        bytes: 0,
                        algo: "test",
                    };
                    let op = OpCtx::new(
                        desc,
                        OpKind::AllReduce,
                        DType::F32,
                        0,
                        7,
                        1,
                        rank,
                        p,
                        CASE_TIMEOUT,
                    );
                    let mut ctx = Ctx {
                        links: &mut links,
                        op,
                    };
                    f(rank, &mut ctx)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// Starts a new case on `ctx`: sets the dtype and restarts the deadline.
pub(crate) fn begin(ctx: &mut Ctx<'_>, dtype: DType) {
    ctx.op.dtype = dtype;
    ctx.op.deadline = Instant::now() + CASE_TIMEOUT;
}

fn encode(dtype: DType, v: i64, out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => out.extend_from_slice(&(v as f32).to_ne_bytes()),
        DType::F64 => out.extend_from_slice(&(v as f64).to_ne_bytes()),
        DType::BF16 => out.extend_from_slice(&bf16::from_f32(v as f32).to_bits().to_ne_bytes()),
        DType::F16 => out.extend_from_slice(&f16::from_f32(v as f32).to_bits().to_ne_bytes()),
        DType::I32 => out.extend_from_slice(&(v as i32).to_ne_bytes()),
        DType::I64 => out.extend_from_slice(&v.to_ne_bytes()),
        DType::U8 => out.push(v as u8),
    }
}

/// Rank `rank`'s input for case `salt`: `count` small integers in [-11, 11] of `dtype`.
pub(crate) fn input(dtype: DType, rank: usize, count: usize, salt: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * dtype.size());
    for i in 0..count {
        encode(
            dtype,
            ((rank * 131 + i * 29 + salt * 17) % 23) as i64 - 11,
            &mut out,
        );
    }
    out
}

/// Rank `rank`'s f32 input with fractions and magnitudes from 1e-3 to 1e3, so that sums in
/// different orders round differently: for checking that all ranks end with identical bytes.
pub(crate) fn input_noisy(rank: usize, count: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * 4);
    for i in 0..count {
        let v = ((rank * 7919 + i * 104_729) % 10_007) as f32 / 10_007.0 - 0.37;
        out.extend_from_slice(&(v * 10f32.powi((i + rank) as i32 % 7 - 3)).to_ne_bytes());
    }
    out
}

/// `inputs[0] op inputs[1] op …`, in member order.
pub(crate) fn reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        reduce_into(dtype, op, &mut acc, x);
    }
    acc
}

/// Element counts swept for team size p: empty, one, fewer than p, odd, a few thousand.
pub(crate) fn counts(p: usize) -> Vec<usize> {
    let mut c = vec![0, 1, p.saturating_sub(1), p + 1, 37, 3001];
    c.sort_unstable();
    c.dedup();
    c
}

/// Byte chunk layouts for a reduce-scatter or all-gather of p members, elements of `esz` bytes:
/// balanced partitions of each of [`counts`], uneven sizes with gaps (and empty chunks), and
/// chunks laid out in reverse member order.
pub(crate) fn layouts(p: usize, esz: usize) -> Vec<Vec<Range<usize>>> {
    let mut out: Vec<Vec<Range<usize>>> = counts(p)
        .into_iter()
        .map(|c| partition(c, p, esz))
        .collect();
    let (mut gaps, mut off) = (Vec::new(), 0);
    for j in 0..p {
        off += (j % 2) * esz;
        let len = ((j * 7 + 3) % 5) * esz;
        gaps.push(off..off + len);
        off += len;
    }
    out.push(gaps);
    let (mut rev, mut off) = (vec![0..0; p], 0);
    for j in (0..p).rev() {
        let len = ((j * 3 + 1) % 4 + 40) * esz;
        rev[j] = off..off + len;
        off += len;
    }
    out.push(rev);
    out
}

fn span(chunks: &[Range<usize>]) -> usize {
    chunks.iter().map(|c| c.end).max().unwrap_or(0)
}

/// Sweeps an all-reduce over team sizes, [`counts`], `dtypes` and sum/max (bf16: sum only) and
/// checks every rank's result against the reference, and that all ranks hold identical bytes.
pub(crate) fn check_all_reduce<R>(sizes: impl IntoIterator<Item = usize>, dtypes: &[DType], run: R)
where
    R: Fn(&Team, &mut Ctx<'_>, usize, &mut [u8], ReduceOp) -> Result<()> + Sync,
{
    for p in sizes {
        let mut cases = Vec::new();
        for count in counts(p) {
            for &dtype in dtypes {
                for &op in OPS
                    .iter()
                    .filter(|&&o| dtype != DType::BF16 || o == ReduceOp::Sum)
                {
                    cases.push((count, dtype, op));
                }
            }
        }
        let outs = run_ranks(p, |me, ctx| {
            let team = Team::world(me, p);
            let mut res = Vec::new();
            for (i, &(count, dtype, op)) in cases.iter().enumerate() {
                begin(ctx, dtype);
                let mut buf = input(dtype, me, count, i);
                run(&team, ctx, count, &mut buf, op).unwrap_or_else(|e| {
                    panic!("p={p} count={count} {dtype:?} {op:?} rank {me}: {e}")
                });
                res.push(buf);
            }
            res
        });
        for (i, &(count, dtype, op)) in cases.iter().enumerate() {
            let inputs: Vec<Vec<u8>> = (0..p).map(|r| input(dtype, r, count, i)).collect();
            let want = reference(dtype, op, &inputs);
            for (r, out) in outs.iter().enumerate() {
                assert!(
                    out[i] == outs[0][i],
                    "p={p} count={count} {dtype:?} {op:?}: rank {r} differs from rank 0"
                );
                assert!(
                    out[i] == want,
                    "p={p} count={count} {dtype:?} {op:?}: rank {r} differs from the reference"
                );
            }
        }
        // Inexact f32 sums: every rank must still hold the same bytes, close to the reference.
        let count = 1001;
        let outs = run_ranks(p, |me, ctx| {
            begin(ctx, DType::F32);
            let mut buf = input_noisy(me, count);
            run(&Team::world(me, p), ctx, count, &mut buf, ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("p={p} noisy rank {me}: {e}"));
            buf
        });
        let want = reference(
            DType::F32,
            ReduceOp::Sum,
            &(0..p).map(|r| input_noisy(r, count)).collect::<Vec<_>>(),
        );
        for (r, out) in outs.iter().enumerate() {
            assert!(
                *out == outs[0],
                "p={p} noisy f32 sum: rank {r} is not bit-identical to rank 0"
            );
            for (a, b) in out.chunks(4).zip(want.chunks(4)) {
                let (a, b) = (
                    f32::from_ne_bytes(a.try_into().unwrap()),
                    f32::from_ne_bytes(b.try_into().unwrap()),
                );
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()) * p as f32,
                    "p={p} noisy f32 sum: {a} vs {b}"
                );
            }
        }
    }
}

/// Runs one large i64 sum all-reduce (megabytes per rank: messages far beyond the socket buffers)
/// on p ranks and checks it.
pub(crate) fn check_large<R>(p: usize, count: usize, run: R)
where
    R: Fn(&Team, &mut Ctx<'_>, usize, &mut [u8], ReduceOp) -> Result<()> + Sync,
{
    let outs = run_ranks(p, |me, ctx| {
        begin(ctx, DType::I64);
        let mut buf = input(DType::I64, me, count, 3);
        run(&Team::world(me, p), ctx, count, &mut buf, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("large p={p} rank {me}: {e}"));
        buf
    });
    let want = reference(
        DType::I64,
        ReduceOp::Sum,
        &(0..p)
            .map(|r| input(DType::I64, r, count, 3))
            .collect::<Vec<_>>(),
    );
    for (r, out) in outs.iter().enumerate() {
        assert!(*out == want, "large p={p} count={count}: rank {r} is wrong");
    }
}

/// Runs an all-reduce on the sub-team of group ranks {1, 3, 4} of a 5-rank group while ranks 0
/// and 2 stay idle, and checks the result.
pub(crate) fn check_sub_team<R>(run: R)
where
    R: Fn(&Team, &mut Ctx<'_>, usize, &mut [u8], ReduceOp) -> Result<()> + Sync,
{
    let ranks = vec![1, 3, 4];
    let cases: Vec<(usize, DType, ReduceOp)> = [0, 1, 2, 37, 1001]
        .into_iter()
        .flat_map(|c| {
            DTYPES
                .iter()
                .flat_map(move |&d| OPS.iter().map(move |&o| (c, d, o)))
        })
        .collect();
    let outs = run_ranks(5, |rank, ctx| {
        let Some(me) = ranks.iter().position(|&r| r == rank) else {
            return Vec::new();
        };
        let team = Team {
            ranks: ranks.clone(),
            me,
        };
        let mut res = Vec::new();
        for (i, &(count, dtype, op)) in cases.iter().enumerate() {
            begin(ctx, dtype);
            let mut buf = input(dtype, me, count, i);
            run(&team, ctx, count, &mut buf, op)
                .unwrap_or_else(|e| panic!("sub-team count={count} rank {rank}: {e}"));
            res.push(buf);
        }
        res
    });
    for (i, &(count, dtype, op)) in cases.iter().enumerate() {
        let inputs: Vec<Vec<u8>> = (0..3).map(|m| input(dtype, m, count, i)).collect();
        let want = reference(dtype, op, &inputs);
        for &r in &ranks {
            assert!(
                outs[r][i] == want,
                "sub-team count={count} {dtype:?} {op:?}: group rank {r} is wrong"
            );
        }
        assert!(outs[0].is_empty() && outs[2].is_empty());
    }
}

/// Sweeps a reduce-scatter over team sizes, chunk [`layouts`], f32/i64 and sum/max: member m's
/// chunk m must equal the reference's chunk m.
pub(crate) fn check_reduce_scatter<R>(sizes: impl IntoIterator<Item = usize>, run: R)
where
    R: Fn(&Team, &mut Ctx<'_>, &[Range<usize>], &mut [u8], ReduceOp) -> Result<()> + Sync,
{
    for p in sizes {
        let mut cases = Vec::new();
        for &dtype in DTYPES {
            for chunks in layouts(p, dtype.size()) {
                for &op in OPS {
                    cases.push((chunks.clone(), dtype, op));
                }
            }
        }
        let outs = run_ranks(p, |me, ctx| {
            let team = Team::world(me, p);
            let mut res = Vec::new();
            for (i, (chunks, dtype, op)) in cases.iter().enumerate() {
                begin(ctx, *dtype);
                let mut buf = input(*dtype, me, span(chunks) / dtype.size(), i);
                run(&team, ctx, chunks, &mut buf, *op)
                    .unwrap_or_else(|e| panic!("p={p} {chunks:?} rank {me}: {e}"));
                res.push(buf);
            }
            res
        });
        for (i, (chunks, dtype, op)) in cases.iter().enumerate() {
            let inputs: Vec<Vec<u8>> = (0..p)
                .map(|r| input(*dtype, r, span(chunks) / dtype.size(), i))
                .collect();
            let want = reference(*dtype, *op, &inputs);
            for (m, out) in outs.iter().enumerate() {
                let c = chunks[m].clone();
                assert!(
                    out[i][c.clone()] == want[c],
                    "p={p} {chunks:?} {dtype:?} {op:?}: member {m}'s chunk is wrong"
                );
            }
        }
    }
}

fn pattern(member: usize, byte: usize) -> u8 {
    (member * 31 + byte * 7 + 1) as u8
}

/// Sweeps an all-gather over team sizes and chunk [`layouts`]: member m starts with only chunk m
/// (the rest of the buffer holds 0xEE) and must end with every chunk, gaps untouched.
pub(crate) fn check_all_gather<R>(sizes: impl IntoIterator<Item = usize>, run: R)
where
    R: Fn(&Team, &mut Ctx<'_>, &[Range<usize>], &mut [u8]) -> Result<()> + Sync,
{
    for p in sizes {
        let cases = layouts(p, 4);
        let outs = run_ranks(p, |me, ctx| {
            let team = Team::world(me, p);
            let mut res = Vec::new();
            for chunks in &cases {
                begin(ctx, DType::F32);
                let mut buf = vec![0xEEu8; span(chunks)];
                for b in chunks[me].clone() {
                    buf[b] = pattern(me, b);
                }
                run(&team, ctx, chunks, &mut buf)
                    .unwrap_or_else(|e| panic!("p={p} {chunks:?} rank {me}: {e}"));
                res.push(buf);
            }
            res
        });
        for (i, chunks) in cases.iter().enumerate() {
            let mut want = vec![0xEEu8; span(chunks)];
            for (j, c) in chunks.iter().enumerate() {
                for b in c.clone() {
                    want[b] = pattern(j, b);
                }
            }
            for (m, out) in outs.iter().enumerate() {
                assert!(
                    out[i] == want,
                    "p={p} {chunks:?}: member {m} did not gather everything"
                );
            }
        }
    }
}
