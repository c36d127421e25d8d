//! The explicit-size thread pool every kernel runs on.
//!
//! Work is split into a fixed number of contiguous parts that depends only
//! on the thread count and the problem size, so a given thread count always
//! gives bit-identical results. Idle workers sleep (rayon parks them after a
//! short spin); nothing busy-waits for long on oversubscribed cores.
use crate::error::{ModelError, Result};
use rayon::prelude::*;

/// A pool of `n` compute threads.
pub struct Threads {
    pool: Option<rayon::ThreadPool>,
    n: usize,
}

impl std::fmt::Debug for Threads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Threads({})", self.n)
    }
}

impl Threads {
    /// A pool with exactly `n` threads (1 runs everything on the caller).
    pub fn new(n: usize) -> Result<Self> {
        if n == 0 {
            return Err(ModelError::Threads {
                threads: n,
                reason: "need at least 1 thread".into(),
            });
        }
        let pool = if n == 1 {
            None
        } else {
            let p = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .thread_name(|i| format!("flotilla-compute-{i}"))
                .build()
                .map_err(|e| ModelError::Threads {
                    threads: n,
                    reason: e.to_string(),
                })?;
            Some(p)
        };
        Ok(Self { pool, n })
    }

    /// One thread, no pool.
    pub fn single() -> Self {
        Self { pool: None, n: 1 }
    }

    /// The thread count.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Run `f(i)` for every `i` in `0..tasks`, spread over the pool.
    pub fn run<F: Fn(usize) + Sync + Send>(&self, tasks: usize, f: F) {
        match &self.pool {
            Some(p) if tasks > 1 => p.install(|| (0..tasks).into_par_iter().for_each(&f)),
            _ => (0..tasks).for_each(f),
        }
    }

    /// Split `0..len` into at most `n` contiguous parts of at least `min`
    /// items each and run `f(range)` for each part in parallel.
    pub fn ranges<F: Fn(std::ops::Range<usize>) + Sync + Send>(
        &self,
        len: usize,
        min: usize,
        f: F,
    ) {
        let parts = self.parts(len, min);
        self.run(parts, |i| f(part_range(len, parts, i)));
    }

    /// Split the rows of `out` (`rows x row_len`) into contiguous blocks, one
    /// per thread, and call `f(first_row, block)` on each.
    pub fn rows<T: Send, F>(&self, out: &mut [T], row_len: usize, f: F)
    where
        F: Fn(usize, &mut [T]) + Sync + Send,
    {
        if row_len == 0 || out.is_empty() {
            return;
        }
        let rows = out.len() / row_len;
        let parts = self.parts(rows, 1);
        let shared = SharedMut::new(out);
        self.run(parts, |i| {
            let r = part_range(rows, parts, i);
            // SAFETY: the row ranges of different parts are disjoint.
            let block = unsafe { shared.slice(r.start * row_len..r.end * row_len) };
            f(r.start, block)
        });
    }

    fn parts(&self, len: usize, min: usize) -> usize {
        let by_size = len / min.max(1);
        self.n.min(by_size).max(1)
    }
}

/// The `i`-th of `parts` near-equal contiguous ranges of `0..len`.
pub fn part_range(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let base = len / parts;
    let extra = len % parts;
    let start = i * base + i.min(extra);
    let end = start + base + usize::from(i < extra);
    start..end
}

/// A mutable slice shared between tasks that write disjoint parts of it.
pub struct SharedMut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: access goes through `slice`, whose contract requires disjointness.
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// Wrap `s` for disjoint parallel writes.
    pub fn new(s: &mut [T]) -> Self {
        Self {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// The whole length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A sub-slice.
    ///
    /// # Safety
    /// No two live sub-slices obtained from this wrapper may overlap, and
    /// the wrapped slice must outlive them.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, r: std::ops::Range<usize>) -> &mut [T] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "SharedMut range {r:?} out of 0..{}",
            self.len
        );
        // SAFETY: in bounds (checked); disjointness is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.end - r.start) }
    }

    /// The raw pointer (for strided writes through GEMM).
    pub fn ptr(&self) -> *mut T {
        self.ptr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_exactly() {
        for len in 0..50 {
            for parts in 1..7 {
                let mut next = 0;
                for i in 0..parts {
                    let r = part_range(len, parts, i);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn rows_visits_each_row_once() {
        let t = Threads::new(3).unwrap();
        let mut v = vec![0u32; 7 * 5];
        t.rows(&mut v, 5, |first, block| {
            for (j, x) in block.iter_mut().enumerate() {
                *x += (first * 5 + j) as u32;
            }
        });
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
        assert!(Threads::new(0).is_err());
    }
}
