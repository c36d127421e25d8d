//! Asynchronous save: the training thread only copies its state into reused host buffers (the
//! foreground pause); a background thread writes, checksums and fsyncs the rank file and then
//! hands the piece list on (to [`crate::commit`] directly when one rank saves alone, or to a
//! coordinator).
//!
//! The host buffer is one anonymous mapping per saver, advised to use huge pages and kept
//! between saves, so from the second save on the pause is a plain memory copy into
//! already-mapped memory (no page faults, no allocation). While a save is in flight the
//! buffer belongs to the background thread; a new save is refused until the previous one has
//! been collected with [`AsyncSaver::wait`] (so no save is ever silently dropped and the
//! buffer is never written while it is being read).
//!
//! Foreground pause and background duration are both reported ([`SaveReport`]).

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::error::{CkptError, Result};
use crate::layout::{Slice, TensorMeta};
use crate::manifest::Piece;
use crate::rank_file::RankWriter;

/// What happens to a rank's piece list once its file is durable: commit it (one rank) or send
/// it to the coordinator. Runs on the background thread.
pub type AfterWrite = Box<dyn FnOnce(u64, Vec<Piece>) -> Result<()> + Send + 'static>;

/// Timing and size of one asynchronous save.
#[derive(Debug, Clone)]
pub struct SaveReport {
    /// The step saved.
    pub step: u64,
    /// Bytes of piece data.
    pub bytes: u64,
    /// Time the caller of [`AsyncSaver::save`] was blocked (copy into the host buffer).
    pub pause: Duration,
    /// Time the background thread took: write, checksum, fsync and the after-write hook.
    pub background: Duration,
}

/// A reused, page-aligned host buffer.
struct HostBuffer {
    map: MmapMut,
}

impl HostBuffer {
    /// A buffer of at least `len` bytes (anonymous mapping, huge pages where the kernel allows,
    /// every page faulted in up front so that no copy into it ever waits on a page fault).
    fn new(len: usize) -> Result<Self> {
        let map = MmapMut::map_anon(len.max(1)).map_err(|source| CkptError::Io {
            op: "map host buffer",
            path: PathBuf::from("<anonymous>"),
            source,
        })?;
        #[cfg(target_os = "linux")]
        {
            // Hints: huge pages first, then fault everything in (kernels before 5.14 lack
            // MADV_POPULATE_WRITE; the first copy then faults the pages in instead).
            let _ = map.advise(memmap2::Advice::HugePage);
            let _ = map.advise(memmap2::Advice::PopulateWrite);
        }
        Ok(HostBuffer { map })
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

/// The background half of a save in flight.
struct InFlight {
    step: u64,
    bytes: u64,
    pause: Duration,
    done: mpsc::Receiver<(HostBuffer, Result<()>, Duration)>,
    thread: JoinHandle<()>,
}

/// One rank's asynchronous saver (see the module doc).
pub struct AsyncSaver {
    root: PathBuf,
    rank: u32,
    copy_threads: usize,
    buffer: Option<HostBuffer>,
    in_flight: Option<InFlight>,
}

impl std::fmt::Debug for AsyncSaver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncSaver")
            .field("root", &self.root)
            .field("rank", &self.rank)
            .field("in_flight", &self.in_flight.as_ref().map(|i| i.step))
            .finish()
    }
}

impl AsyncSaver {
    /// A saver for `rank` writing under `root`. The host buffer is allocated by the first save
    /// and reused (grown if a later save is larger).
    pub fn new(root: &Path, rank: u32) -> Self {
        AsyncSaver {
            root: root.to_path_buf(),
            rank,
            copy_threads: 1,
            buffer: None,
            in_flight: None,
        }
    }

    /// Splits the foreground copy over `threads` threads (default 1: one per rank is right when
    /// every core hosts a rank).
    pub fn with_copy_threads(mut self, threads: usize) -> Self {
        self.copy_threads = threads.max(1);
        self
    }

    /// Maps the host buffer for saves of up to `bytes` now (a one-time cost of the first save
    /// otherwise). No-op if the buffer is already that large; refused while a save is pending.
    pub fn reserve(&mut self, bytes: usize) -> Result<()> {
        if let Some(prev) = &self.in_flight {
            return Err(CkptError::SaveInFlight {
                step: prev.step,
                previous: prev.step,
            });
        }
        if self.buffer.as_ref().is_none_or(|b| b.len() < bytes) {
            self.buffer = Some(HostBuffer::new(bytes)?);
        }
        Ok(())
    }

    /// The step whose save is in flight or not yet collected, if any.
    pub fn pending(&self) -> Option<u64> {
        self.in_flight.as_ref().map(|i| i.step)
    }

    /// Copies `pieces` (tensor, slice, row-major bytes) into the host buffer and returns once
    /// they are copied; a background thread then writes them as this rank's file of `step` and
    /// passes the piece list to `after`. Returns the foreground pause. Refused while an earlier
    /// save has not been collected with [`AsyncSaver::wait`].
    pub fn save(
        &mut self,
        step: u64,
        pieces: &[(&TensorMeta, &Slice, &[u8])],
        after: AfterWrite,
    ) -> Result<Duration> {
        if let Some(prev) = &self.in_flight {
            return Err(CkptError::SaveInFlight {
                step,
                previous: prev.step,
            });
        }
        let start = Instant::now();
        let total: usize = pieces.iter().map(|(_, _, d)| d.len()).sum();
        let mut buffer = match self.buffer.take() {
            Some(b) if b.len() >= total => b,
            _ => HostBuffer::new(total)?,
        };
        copy_in(&mut buffer.map[..total], pieces, self.copy_threads);
        let pause = start.elapsed();

        let metas: Vec<(TensorMeta, Slice, usize)> = pieces
            .iter()
            .map(|(t, s, d)| ((*t).clone(), (*s).clone(), d.len()))
            .collect();
        let (root, rank) = (self.root.clone(), self.rank);
        let (tx, done) = mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name(format!("ckpt-save-r{rank}"))
            .spawn(move || {
                let t = Instant::now();
                let result = write_from(&root, step, rank, &metas, &buffer.map[..])
                    .and_then(|pieces| after(step, pieces));
                let _ = tx.send((buffer, result, t.elapsed()));
            })
            .map_err(|source| CkptError::Io {
                op: "spawn save thread",
                path: self.root.clone(),
                source,
            })?;
        self.in_flight = Some(InFlight {
            step,
            bytes: total as u64,
            pause,
            done,
            thread,
        });
        Ok(pause)
    }

    /// Waits up to `timeout` for the save in flight and collects it: `Ok(None)` if none was in
    /// flight, its report if it succeeded, its error if it failed (the host buffer is kept
    /// either way). On timeout the save stays in flight and [`CkptError::SaveTimeout`] is
    /// returned.
    pub fn wait(&mut self, timeout: Duration) -> Result<Option<SaveReport>> {
        let Some(flight) = self.in_flight.take() else {
            return Ok(None);
        };
        match flight.done.recv_timeout(timeout) {
            Ok((buffer, result, background)) => {
                self.buffer = Some(buffer);
                let _ = flight.thread.join();
                result.map(|()| {
                    Some(SaveReport {
                        step: flight.step,
                        bytes: flight.bytes,
                        pause: flight.pause,
                        background,
                    })
                })
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let step = flight.step;
                self.in_flight = Some(flight);
                Err(CkptError::SaveTimeout { step, timeout })
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(CkptError::SaveThreadDied { step: flight.step })
            }
        }
    }
}

/// Writes the pieces laid out back to back in `buffer` as `rank`'s file of `step`.
fn write_from(
    root: &Path,
    step: u64,
    rank: u32,
    metas: &[(TensorMeta, Slice, usize)],
    buffer: &[u8],
) -> Result<Vec<Piece>> {
    let mut at = 0;
    let pieces: Vec<(&TensorMeta, &Slice, &[u8])> = metas
        .iter()
        .map(|(t, s, len)| {
            let data = &buffer[at..at + len];
            at += len;
            (t, s, data)
        })
        .collect();
    RankWriter::write_all(root, step, rank, &pieces)
}

/// Copies the pieces' bytes back to back into `dst` (exactly their total length), split into
/// `threads` equal byte ranges copied in parallel.
fn copy_in(dst: &mut [u8], pieces: &[(&TensorMeta, &Slice, &[u8])], threads: usize) {
    let part = dst.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        for (i, out) in dst.chunks_mut(part).enumerate() {
            let begin = i * part;
            if threads > 1 {
                scope.spawn(move || copy_range(out, begin, pieces));
            } else {
                copy_range(out, begin, pieces);
            }
        }
    });
}

/// Fills `out` with bytes `begin .. begin + out.len()` of the pieces' concatenation.
fn copy_range(out: &mut [u8], begin: usize, pieces: &[(&TensorMeta, &Slice, &[u8])]) {
    let end = begin + out.len();
    let mut at = 0;
    for (_, _, data) in pieces {
        let (lo, hi) = (at.max(begin), (at + data.len()).min(end));
        if lo < hi {
            out[lo - begin..hi - begin].copy_from_slice(&data[lo - at..hi - at]);
        }
        at += data.len();
        if at >= end {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::DType;

    #[test]
    fn parallel_copy_matches_concatenation() {
        let t = TensorMeta {
            name: "t".into(),
            dtype: DType::U8,
            shape: vec![100],
        };
        let s = Slice::new(&[(0, 1)]);
        let a: Vec<u8> = (0..37).collect();
        let b: Vec<u8> = (100..161).collect();
        let c: Vec<u8> = (200..202).collect();
        let pieces = [(&t, &s, &a[..]), (&t, &s, &b[..]), (&t, &s, &c[..])];
        let want: Vec<u8> = [a.clone(), b.clone(), c.clone()].concat();
        for threads in [1, 2, 3, 7, 200] {
            let mut dst = vec![0u8; want.len()];
            copy_in(&mut dst, &pieces, threads);
            assert_eq!(dst, want, "{threads} threads");
        }
    }
}
