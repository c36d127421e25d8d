//! Asynchronous ops: submit now, compute, wait later.
//!
//! An async call takes its place in the op order at once (so it cannot be overtaken), moves its
//! owned buffer to the group's worker thread, and returns a [`Work`] handle; the worker runs the
//! op in the background while the caller computes, and `wait` hands the buffer back.

use super::core::{OpOptions, ProcessGroup};
use crate::dtype::{Element, ReduceOp, as_bytes, as_bytes_mut};
use crate::error::{CommError, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Slot<T> {
    value: Mutex<Option<Result<T>>>,
    cv: Condvar,
}

/// Handle of an op running in the background.
pub struct Work<T> {
    slot: Arc<Slot<T>>,
    /// Upper bound for `wait`: the op's own timeout plus a margin for ops queued before it.
    limit: Duration,
}

impl<T> Work<T> {
    /// Whether the op has finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.slot
            .value
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Blocks until the op finishes and returns its result (the buffer, for ops that own one).
    pub fn wait(self) -> Result<T> {
        let limit = self.limit;
        self.wait_timeout(limit)
    }

    /// Blocks at most `timeout`.
    pub fn wait_timeout(self, timeout: Duration) -> Result<T> {
        let deadline = Instant::now() + timeout;
        let mut v = self.slot.value.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = v.take() {
                return r;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::InvalidArgument(format!(
                    "async op still running after waiting {timeout:?}"
                )));
            }
            v = self
                .slot
                .cv
                .wait_timeout(v, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl ProcessGroup {
    fn submit<T: Send + 'static>(
        &self,
        timeout: Option<Duration>,
        job: impl FnOnce(&ProcessGroup) -> Result<T> + Send + 'static,
    ) -> Result<Work<T>> {
        let slot = Arc::new(Slot {
            value: Mutex::new(None),
            cv: Condvar::new(),
        });
        let (s2, g) = (slot.clone(), self.clone());
        self.spawn_job(Box::new(move || {
            let r = job(&g);
            *s2.value.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            s2.cv.notify_all();
        }))?;
        let op_timeout = timeout.unwrap_or(self.inner.cfg.timeout);
        Ok(Work {
            slot,
            limit: op_timeout * 2 + Duration::from_secs(5),
        })
    }

    /// Background [`all_reduce`](Self::all_reduce): returns the reduced buffer on `wait`.
    pub fn all_reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
        opts: OpOptions,
    ) -> Result<Work<Vec<T>>> {
        let turn = self.collective_turn();
        self.submit(opts.timeout, move |g| {
            g.all_reduce_turn(turn, as_bytes_mut(&mut buf), T::DTYPE, op, &opts)?;
            Ok(buf)
        })
    }

    /// Background [`reduce_scatter`](Self::reduce_scatter): returns `(input, output)` on
    /// `wait`, so that a caller can reuse both buffers.
    pub fn reduce_scatter_async<T: Element>(
        &self,
        input: Vec<T>,
        mut output: Vec<T>,
        op: ReduceOp,
        opts: OpOptions,
    ) -> Result<Work<(Vec<T>, Vec<T>)>> {
        if input.len() != output.len() * self.size() {
            return Err(CommError::InvalidArgument(format!(
                "reduce_scatter_async: input {} != size {} x output {}",
                input.len(),
                self.size(),
                output.len()
            )));
        }
        let turn = self.collective_turn();
        self.submit(opts.timeout, move |g| {
            g.reduce_scatter_turn(
                turn,
                as_bytes(&input),
                as_bytes_mut(&mut output),
                T::DTYPE,
                op,
                &opts,
            )?;
            Ok((input, output))
        })
    }

    /// Background [`all_gather`](Self::all_gather) (equal sizes): returns `(input, output)` on
    /// `wait`, so that a caller can reuse both buffers.
    pub fn all_gather_async<T: Element>(
        &self,
        input: Vec<T>,
        mut output: Vec<T>,
        opts: OpOptions,
    ) -> Result<Work<(Vec<T>, Vec<T>)>> {
        if output.len() != input.len() * self.size() {
            return Err(CommError::InvalidArgument(format!(
                "all_gather_async: output {} != size {} x input {}",
                output.len(),
                self.size(),
                input.len()
            )));
        }
        let counts = vec![input.len(); self.size()];
        let turn = self.collective_turn();
        self.submit(opts.timeout, move |g| {
            g.all_gather_turn(
                turn,
                as_bytes(&input),
                as_bytes_mut(&mut output),
                &counts,
                T::DTYPE,
                &opts,
            )?;
            Ok((input, output))
        })
    }
}
