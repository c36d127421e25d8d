//! Data-parallel gradient synchronisation: buckets over the flat gradient buffer, each
//! all-reduced as soon as the backward has finished it (file 000, "数据并行": the five-stage
//! step, bucketing and overlap).
//!
//! The backward reports final gradient ranges from the top of the buffer down (the head, then
//! blocks from the last to the first, then the embeddings: `Model::backward_hooked`). Buckets
//! are planned over that order in the constructor: consecutive ranges are merged until a bucket
//! holds at least `bucket_bytes`, so every bucket is one contiguous slice of the buffer and
//! becomes complete the moment the backward passes below its start. It is then copied into an
//! owned buffer and handed to the process group's background worker (`all_reduce_async`); the
//! backward carries on meanwhile. After the backward, [`GradBuckets::finish`] waits for every
//! bucket, writes the sums back and scales them by 1/N, so each rank holds the gradient of the
//! mean loss over the global batch. Only that wait is exposed communication.
//!
//! Cost per step (ring all-reduce, 004 eq. 28.11): 2 (N-1)/N x 4 P bytes on the wire per rank
//! for P parameters, in `buckets` operations of alpha latency each.

use std::ops::Range;
use std::time::{Duration, Instant};

use comm::dtype::ReduceOp;
use comm::group::{OpOptions, ProcessGroup, Work};
use model::layout::Layout;

use crate::error::{Result, TrainError};

/// Default bucket size: 1 MiB, PyTorch DDP's first-bucket size (its later buckets are 25 MiB).
/// On the 2-core machine of docs/PERFORMANCE.md, 1 MiB buckets trained the peer benchmark's
/// "small" model at 2334 tokens/s against 1861 with 25 MiB (a 25 MiB bucket holds the whole
/// 56 MB gradient in two pieces, so almost nothing overlaps the backward); at about 100 us per
/// all-reduce, a 500 MB gradient in 1 MiB buckets spends some 50 ms a step in latency, small
/// beside its compute. `--bucket-mb` sets it.
pub const DEFAULT_BUCKET_BYTES: usize = 1 << 20;

/// Buckets of at least `bucket_bytes` over `layout`'s flat buffer, in the order the backward
/// finishes them (the head, the blocks from the last down, the embeddings; see the module doc):
/// consecutive units are merged until a bucket reaches the size, so each bucket is one
/// contiguous range. With `bucket_bytes` of 1 every unit is its own bucket.
pub fn plan_buckets(layout: &Layout, bucket_bytes: usize) -> Vec<Range<usize>> {
    let elems = (bucket_bytes / 4).max(1);
    let mut buckets: Vec<Range<usize>> = Vec::new();
    for unit in layout.units().into_iter().rev() {
        let r = layout.unit_range(unit);
        if r.is_empty() {
            continue;
        }
        match buckets.last_mut() {
            Some(b) if b.len() < elems && r.end == b.start => b.start = r.start,
            _ => buckets.push(r),
        }
    }
    buckets
}

/// The gradient buckets of one data-parallel rank (see the module doc).
pub struct GradBuckets {
    group: ProcessGroup,
    /// Bucket ranges over the flat buffer, from the top of the buffer down (launch order).
    buckets: Vec<Range<usize>>,
    /// Buckets launched this step, in order, with their handles.
    inflight: Vec<Work<Vec<f32>>>,
    /// Reusable owned buffers, one per bucket.
    spare: Vec<Vec<f32>>,
    /// Lowest gradient index known final this step.
    ready_from: usize,
    /// An error raised inside the backward hook, reported by `finish`.
    failed: Option<TrainError>,
    /// The options of the buckets' all-reduces (the group's choice unless pinned).
    options: OpOptions,
}

impl GradBuckets {
    /// The buckets' all-reduces with `options` (a pinned algorithm: tensor-parallel ranks'
    /// groups must sum their replicated tensors in the same order).
    pub fn with_options(mut self, options: OpOptions) -> Self {
        self.options = options;
        self
    }

    /// Plans buckets of at least `bucket_bytes` over `layout`'s gradient buffer for `group`.
    pub fn new(group: ProcessGroup, layout: &Layout, bucket_bytes: usize) -> Self {
        Self::over(group, plan_buckets(layout, bucket_bytes), layout.total)
    }

    /// Buckets over explicit `buckets` (each one contiguous range, in the order the backward
    /// finishes them: descending starts) of a gradient buffer of `total` elements, for a
    /// backward that reports its final ranges from the top down (a pipeline stage's units).
    pub fn over(group: ProcessGroup, buckets: Vec<Range<usize>>, total: usize) -> Self {
        let spare = buckets
            .iter()
            .map(|b| Vec::with_capacity(b.len()))
            .collect();
        GradBuckets {
            group,
            buckets,
            inflight: Vec::new(),
            spare,
            ready_from: total,
            failed: None,
            options: OpOptions::default(),
        }
    }

    /// The planned bucket ranges, in launch order.
    pub fn buckets(&self) -> &[Range<usize>] {
        &self.buckets
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Backward hook: `range` of `grads` is final. Launches every bucket now complete.
    pub fn ready(&mut self, range: Range<usize>, grads: &[f32]) {
        self.ready_from = self.ready_from.min(range.start);
        while self.failed.is_none() {
            let next = self.inflight.len();
            let Some(bucket) = self.buckets.get(next).cloned() else {
                break;
            };
            if bucket.start < self.ready_from {
                break;
            }
            let mut buf = std::mem::take(&mut self.spare[next]);
            buf.clear();
            buf.extend_from_slice(&grads[bucket]);
            match self
                .group
                .all_reduce_async(buf, ReduceOp::Sum, self.options)
            {
                Ok(work) => self.inflight.push(work),
                Err(e) => self.failed = Some(e.into()),
            }
        }
    }

    /// After the backward: waits for every bucket, writes the reduced sums back into `grads`
    /// scaled by `scale` / N (`scale` = 1 / micro-batches under gradient accumulation). Returns
    /// the time spent waiting (the exposed communication).
    pub fn finish(&mut self, grads: &mut [f32], scale: f32) -> Result<Duration> {
        let start = Instant::now();
        // Buckets not launched by the hook (a backward that reported nothing) go now.
        self.ready(0..0, grads);
        let scale = scale / self.group.size() as f32;
        let inflight = std::mem::take(&mut self.inflight);
        let mut first_err = self.failed.take();
        for (i, work) in inflight.into_iter().enumerate() {
            match work.wait() {
                Ok(buf) => {
                    for (g, s) in grads[self.buckets[i].clone()].iter_mut().zip(&buf) {
                        *g = s * scale;
                    }
                    self.spare[i] = buf;
                }
                Err(e) => {
                    first_err.get_or_insert(e.into());
                }
            }
        }
        self.ready_from = grads.len();
        match first_err {
            Some(e) => Err(e),
            None => Ok(start.elapsed()),
        }
    }

    /// Bytes of the owned bucket buffers kept between steps (one gradient's worth once every
    /// bucket has run).
    pub fn buffer_bytes(&self) -> usize {
        self.spare.iter().map(|b| b.capacity() * 4).sum()
    }

    /// The mean of `value` over the ranks (a scalar all-reduce, e.g. of the loss).
    pub fn mean(&self, value: f64) -> Result<f64> {
        let mut v = [value];
        self.group.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok(v[0] / self.group.size() as f64)
    }
}
