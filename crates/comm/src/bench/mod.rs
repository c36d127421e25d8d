//! The collective benchmark's buffers and calls (`flotilla bench comm`), and its check of
//! every result against a closed form ([`check`]).
pub mod check;

use crate::buffer::HostBuffer;
use crate::error::Result;
use crate::group::{OpOptions, ProcessGroup};
use crate::{DType, OpKind, ReduceOp};

/// nccl-tests' bus-bandwidth factor of `op` over `w` ranks: 2(W-1)/W for all-reduce, (W-1)/W
/// for all-gather, reduce-scatter and all-to-all, 1 otherwise.
pub fn bus_factor(op: OpKind, w: usize) -> f64 {
    let wf = w as f64;
    match op {
        OpKind::AllReduce => 2.0 * (wf - 1.0) / wf,
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => (wf - 1.0) / wf,
        _ => 1.0,
    }
}

/// Buffers for one op and size.
///
/// Large buffers are huge-page aligned and advised ([`HostBuffer`]), as numpy (the MPI peer's
/// buffers) does for large arrays.
pub struct Bufs {
    /// The input (and the output of in-place ops).
    pub a: HostBuffer,
    /// The output of all-gather, reduce-scatter and all-to-all.
    pub b: HostBuffer,
}

/// Buffers of `op` at `size` bytes for rank `rank` of `w`, elements of `esz` bytes: the input
/// holds `(rank + i) % 7` in every element's low byte ([`check::check_once`] knows the closed
/// form of every op's result).
pub fn buffers(op: OpKind, size: usize, w: usize, esz: usize, rank: usize) -> Bufs {
    // Whole elements; all-gather / reduce-scatter / all-to-all need a multiple of W elements.
    let per = |n: usize| (n / esz / w) * esz;
    let (a, b) = match op {
        OpKind::AllGather => (per(size), per(size) * w),
        OpKind::ReduceScatter => (per(size) * w, per(size)),
        OpKind::AllToAll => (per(size) * w, per(size) * w),
        _ => (size / esz * esz, 0),
    };
    let mut av = HostBuffer::zeroed(a);
    // Small integers in every element's low byte: valid for every dtype and no overflow.
    for (i, e) in av.chunks_exact_mut(esz).enumerate() {
        e[0] = ((rank + i) % 7) as u8;
    }
    Bufs {
        a: av,
        b: HostBuffer::zeroed(b),
    }
}

/// Runs `op` once over `bufs` (sum reductions, root 0).
pub fn call(
    g: &ProcessGroup,
    op: OpKind,
    bufs: &mut Bufs,
    dtype: DType,
    opts: &OpOptions,
) -> Result<()> {
    let w = g.size();
    match op {
        OpKind::AllReduce => g.all_reduce_bytes(&mut bufs.a, dtype, ReduceOp::Sum, opts),
        OpKind::Broadcast => g.broadcast_bytes(&mut bufs.a, dtype, 0, opts),
        OpKind::Reduce => g.reduce_bytes(&mut bufs.a, dtype, 0, ReduceOp::Sum, opts),
        OpKind::AllGather => {
            let counts = vec![bufs.a.len() / dtype.size(); w];
            g.all_gather_bytes(&bufs.a, &mut bufs.b, &counts, dtype, opts)
        }
        OpKind::ReduceScatter => {
            g.reduce_scatter_bytes(&bufs.a, &mut bufs.b, dtype, ReduceOp::Sum, opts)
        }
        OpKind::AllToAll => {
            // Moved as u8 blocks: all-to-all does not look at the element type.
            let counts = vec![bufs.a.len() / w; w];
            let Bufs { a, b } = bufs;
            g.all_to_all_v_with(&a[..], &counts, &mut b[..], &counts, opts)
        }
        other => Err(crate::CommError::InvalidArgument(format!(
            "{}: not a benchmarked collective",
            other.name()
        ))),
    }
}

/// How [`measure`] times an op: check one call's result first, then run as many calls as fit
/// `target_seconds` (from the last of five warm-up calls), within `iters` (min, max).
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Check one call's result against its closed form ([`check::check_once`]) first.
    pub check: bool,
    /// Seconds the timed calls should take together.
    pub target_seconds: f64,
    /// Fewest and most timed calls.
    pub iters: (usize, usize),
}

/// Times `op` over `size` bytes of `dtype` on `g` (`algo` forced, or the group's choice):
/// per-call seconds (the slowest rank's) and the algorithm's name. Collective.
pub fn measure(
    g: &ProcessGroup,
    op: OpKind,
    size: usize,
    dtype: DType,
    algo: Option<crate::algo::Algo>,
    how: &Timing,
) -> Result<(Vec<f64>, &'static str)> {
    let mut bufs = buffers(op, size, g.size(), dtype.size(), g.rank());
    let opts = OpOptions {
        algo,
        timeout: None,
    };
    // The algorithm the op runs: the forced one, or the group's choice (the same on every call).
    let algo_name = algo.unwrap_or_else(|| g.explain(op, size).algo).name();
    let mut run = || call(g, op, &mut bufs, dtype, &opts);
    // Warm-up: five calls; the last one's time sizes the run.
    let warm = g.timed_calls(5, &mut run)?.last().copied().unwrap_or(1e-3);
    if how.check {
        check::check_once(g, op, size, dtype, &opts)?;
    }
    let (lo, hi) = how.iters;
    let mut iters =
        [((how.target_seconds / warm.max(1e-7)) as i64).clamp(lo as i64, hi.max(lo) as i64)];
    g.broadcast(&mut iters, 0)?;
    g.timed_calls(iters[0] as usize, &mut run)
        .map(|times| (times, algo_name))
}
