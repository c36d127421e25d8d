//! `flotilla bench comm --check`: verifies one call's result per op and size against the closed
//! form of the inputs that [`buffers`] writes, so a wrong collective fails the benchmark loudly.

use super::{Bufs, buffers, call};
use crate::error::{CommError, Result};
use crate::group::{OpOptions, ProcessGroup};
use crate::{DType, OpKind, ReduceOp};

/// `--check`: refills the buffers, runs one call and compares this rank's result with the closed
/// form of [`buffers`] (element i of rank r holds (r+i)%7 in its low byte). Every rank learns
/// which ranks saw a wrong result, so all of them fail together with the same message.
pub fn check_once(
    g: &ProcessGroup,
    op: OpKind,
    size: usize,
    dtype: DType,
    opts: &OpOptions,
) -> Result<()> {
    let (w, rank) = (g.size(), g.rank());
    let mut bufs = buffers(op, size, w, dtype.size(), rank);
    call(g, op, &mut bufs, dtype, opts)?;
    let bad = verify(op, &bufs, w, rank, dtype);
    // First bad element index per rank (-1: correct), known to every rank.
    let mut first_bad = vec![-1i64; w];
    if let Some(b) = &bad {
        first_bad[rank] = b.index as i64;
    }
    g.all_reduce(&mut first_bad, ReduceOp::Max)?;
    let wrong: Vec<usize> = (0..w).filter(|&r| first_bad[r] >= 0).collect();
    if let Some(b) = bad {
        return Err(CommError::WrongResult(format!(
            "--check: {} of {size} B ({}, algo {}) is wrong on rank {rank}: first bad element index {} \
             (expected {}, got {}; {} of {} elements wrong; wrong ranks {wrong:?})",
            op.name(),
            dtype.name(),
            g.last_selection().map_or("-", |s| s.algo.name()),
            b.index,
            b.expected,
            b.actual,
            b.wrong,
            b.total,
        )));
    }
    if !wrong.is_empty() {
        return Err(CommError::WrongResult(format!(
            "--check: {} of {size} B ({}) is wrong on rank(s) {wrong:?} (first bad element indices {:?}); \
             rank {rank} is correct",
            op.name(),
            dtype.name(),
            wrong.iter().map(|&r| first_bad[r]).collect::<Vec<_>>()
        )));
    }
    Ok(())
}

/// The first wrong element of a checked result.
struct Mismatch {
    index: usize,
    expected: String,
    actual: String,
    wrong: usize,
    total: usize,
}

/// The value `buffers` puts in element `i` of rank `r` (as an integer in the low bytes).
fn input_val(r: usize, i: usize) -> u64 {
    ((r + i) % 7) as u64
}

/// Compares `out` (elements of `dtype`) with `want(i)`, the expected element i as the integer in
/// its low bytes. Integer dtypes compare bytes; float dtypes compare values (the integer is the
/// bit pattern of a small denormal, and sums of such denormals are exact).
fn compare(out: &[u8], dtype: DType, want: impl Fn(usize) -> u64) -> Option<Mismatch> {
    let esz = dtype.size();
    let total = out.len() / esz;
    let mut first: Option<(usize, u64, u64)> = None;
    let mut wrong = 0;
    for i in 0..total {
        let mut raw = [0u8; 8];
        raw[..esz].copy_from_slice(&out[i * esz..(i + 1) * esz]);
        let got = u64::from_le_bytes(raw);
        let exp = want(i);
        let ok = match dtype {
            DType::F32 | DType::F64 | DType::BF16 | DType::F16 => {
                float_value(dtype, got) == float_value(dtype, exp)
            }
            _ => got == exp,
        };
        if !ok {
            wrong += 1;
            if first.is_none() {
                first = Some((i, exp, got));
            }
        }
    }
    first.map(|(index, exp, got)| {
        let show = |bits: u64| match dtype {
            DType::F32 | DType::F64 | DType::BF16 | DType::F16 => {
                format!("{:e} (bits {bits:#x})", float_value(dtype, bits))
            }
            _ => format!("{bits:#x}"),
        };
        Mismatch {
            index,
            expected: show(exp),
            actual: show(got),
            wrong,
            total,
        }
    })
}

/// The value of a float element from its bit pattern.
fn float_value(dtype: DType, bits: u64) -> f64 {
    match dtype {
        DType::F32 => f32::from_bits(bits as u32) as f64,
        DType::F64 => f64::from_bits(bits),
        DType::BF16 => f32::from_bits((bits as u32) << 16) as f64,
        DType::F16 => {
            let (sign, exp, man) = ((bits >> 15) & 1, (bits >> 10) & 0x1f, bits & 0x3ff);
            let mag = match exp {
                0 => man as f64 * 2f64.powi(-24),
                31 if man == 0 => f64::INFINITY,
                31 => f64::NAN,
                e => (1.0 + man as f64 / 1024.0) * 2f64.powi(e as i32 - 15),
            };
            if sign == 1 { -mag } else { mag }
        }
        _ => bits as f64,
    }
}

/// Checks this rank's result of `op` on the buffers of [`buffers`].
fn verify(op: OpKind, bufs: &Bufs, w: usize, rank: usize, dtype: DType) -> Option<Mismatch> {
    let esz = dtype.size();
    let sum = |i: usize| (0..w).map(|r| input_val(r, i)).sum::<u64>();
    match op {
        OpKind::AllReduce => compare(&bufs.a, dtype, sum),
        OpKind::Reduce if rank == 0 => compare(&bufs.a, dtype, sum),
        // Other ranks' buffers are left unchanged.
        OpKind::Reduce => compare(&bufs.a, dtype, |i| input_val(rank, i)),
        OpKind::Broadcast => compare(&bufs.a, dtype, |i| input_val(0, i)),
        OpKind::AllGather => {
            // Block s of the output is rank s's input.
            let per = bufs.a.len() / esz;
            compare(&bufs.b, dtype, |i| {
                input_val(i / per.max(1), i % per.max(1))
            })
        }
        OpKind::ReduceScatter => {
            // This rank's output is block `rank` of the element-wise sum of the inputs.
            let per = bufs.b.len() / esz;
            compare(&bufs.b, dtype, |i| sum(rank * per + i))
        }
        OpKind::AllToAll => {
            // Block s of the output is block `rank` of rank s's input (moved as bytes).
            let blk = bufs.b.len() / w / esz;
            compare(&bufs.b, dtype, |i| {
                let (s, k) = (i / blk.max(1), i % blk.max(1));
                input_val(s, rank * blk + k)
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::HostBuffer;

    /// Element-wise sum of `dtype` buffers computed with the type's own arithmetic (independent
    /// of `verify`'s integer closed form).
    fn add(dtype: DType, acc: &mut [u8], src: &[u8]) {
        let esz = dtype.size();
        for (a, s) in acc.chunks_exact_mut(esz).zip(src.chunks_exact(esz)) {
            match dtype {
                DType::F32 => {
                    let x = f32::from_le_bytes(a.try_into().unwrap())
                        + f32::from_le_bytes(s.try_into().unwrap());
                    a.copy_from_slice(&x.to_le_bytes());
                }
                DType::F64 => {
                    let x = f64::from_le_bytes(a.try_into().unwrap())
                        + f64::from_le_bytes(s.try_into().unwrap());
                    a.copy_from_slice(&x.to_le_bytes());
                }
                DType::BF16 => {
                    let f =
                        |b: &[u8]| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                    let x = f(a) + f(s);
                    a.copy_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes());
                }
                _ => {
                    let mut x = [0u8; 8];
                    let mut y = [0u8; 8];
                    x[..esz].copy_from_slice(a);
                    y[..esz].copy_from_slice(s);
                    let z = u64::from_le_bytes(x).wrapping_add(u64::from_le_bytes(y));
                    a.copy_from_slice(&z.to_le_bytes()[..esz]);
                }
            }
        }
    }

    /// What each rank's buffers hold after `op`, computed naively.
    fn simulate(op: OpKind, size: usize, w: usize, dtype: DType) -> Vec<Bufs> {
        let esz = dtype.size();
        let mut b: Vec<Bufs> = (0..w).map(|r| buffers(op, size, w, esz, r)).collect();
        let total = |b: &[Bufs]| {
            let mut s = b[0].a.clone();
            for x in &b[1..] {
                add(dtype, &mut s, &x.a);
            }
            s
        };
        match op {
            OpKind::AllReduce => {
                let s = total(&b);
                b.iter_mut().for_each(|x| x.a = s.clone());
            }
            OpKind::Reduce => b[0].a = total(&b),
            OpKind::Broadcast => {
                let s = b[0].a.clone();
                b.iter_mut().for_each(|x| x.a = s.clone());
            }
            OpKind::AllGather => {
                let s: Vec<u8> = b.iter().flat_map(|x| x.a.to_vec()).collect();
                b.iter_mut().for_each(|x| x.b = HostBuffer::from(&s[..]));
            }
            OpKind::ReduceScatter => {
                let s = total(&b);
                let per = b[0].b.len();
                for (r, x) in b.iter_mut().enumerate() {
                    x.b = HostBuffer::from(&s[r * per..(r + 1) * per]);
                }
            }
            OpKind::AllToAll => {
                let blk = b[0].a.len() / w;
                let ins: Vec<Vec<u8>> = b.iter().map(|x| x.a.to_vec()).collect();
                for (r, x) in b.iter_mut().enumerate() {
                    let v: Vec<u8> = (0..w)
                        .flat_map(|s| ins[s][r * blk..(r + 1) * blk].to_vec())
                        .collect();
                    x.b = HostBuffer::from(&v[..]);
                }
            }
            _ => unreachable!(),
        }
        b
    }

    const OPS: [OpKind; 6] = [
        OpKind::AllReduce,
        OpKind::Reduce,
        OpKind::Broadcast,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
    ];

    #[test]
    fn verify_accepts_correct_results() {
        for op in OPS {
            for w in 1..=5 {
                for dtype in [
                    DType::F32,
                    DType::F64,
                    DType::BF16,
                    DType::I32,
                    DType::I64,
                    DType::U8,
                ] {
                    for size in [0, 8, 1000, 4096, 12345] {
                        for (r, b) in simulate(op, size, w, dtype).iter().enumerate() {
                            if let Some(m) = verify(op, b, w, r, dtype) {
                                panic!(
                                    "{} w={w} {} size={size} rank {r}: index {} expected {} got {}",
                                    op.name(),
                                    dtype.name(),
                                    m.index,
                                    m.expected,
                                    m.actual
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn verify_names_the_first_bad_element() {
        for op in OPS {
            for dtype in [DType::F32, DType::I32, DType::F16] {
                let w = 3;
                let mut b = buffers(op, 4096, w, dtype.size(), 0);
                // Fake a result: the expected one (from verify's own closed form) is not needed;
                // any wrong byte at element 7 must be reported there (and nothing earlier).
                let mut good = simulate_or_input(op, w, dtype);
                let out = if good.b.is_empty() {
                    &mut good.a
                } else {
                    &mut good.b
                };
                out[7 * dtype.size()] ^= 0x40;
                b.a = good.a;
                b.b = good.b;
                let m = verify(op, &b, w, 0, dtype).expect("corruption detected");
                assert_eq!(m.index, 7, "{} {}", op.name(), dtype.name());
                assert_eq!(m.wrong, 1);
            }
        }
    }

    /// Rank 0's correct result (f16 has no simulator: its inputs are small enough that every
    /// op's f16 result equals the u16 one bit for bit).
    fn simulate_or_input(op: OpKind, w: usize, dtype: DType) -> Bufs {
        let sim = if dtype == DType::F16 {
            DType::I32
        } else {
            dtype
        };
        let b = simulate(op, 4096, w, sim).swap_remove(0);
        if dtype != DType::F16 {
            return b;
        }
        // Re-pack i32 elements as u16 (the values are below 2^11: exact f16 denormal bits).
        let pack = |v: &[u8]| -> Vec<u8> {
            v.chunks_exact(4)
                .flat_map(|c| (u32::from_le_bytes(c.try_into().unwrap()) as u16).to_le_bytes())
                .collect()
        };
        let copy = |v: Vec<u8>| {
            let mut h = HostBuffer::zeroed(v.len());
            h.copy_from_slice(&v);
            h
        };
        Bufs {
            a: copy(pack(&b.a)),
            b: copy(pack(&b.b)),
        }
    }
}
