//! The checkpoint benchmark's mechanics (`flotilla ckpt bench` prints them): checkpoint save
//! and load bandwidth against the disk's own sequential write and read bandwidth, measured in
//! the same round on the same directory.
//!
//! The state is 8 float32 tensors of shape `[rows, 4096]` (rows chosen so the total is about
//! the requested size), split by rows across ranks. Each round measures, in order: the disk's
//! own sequential bandwidth with as many streams as ranks (each thread writes one plain file of
//! its share in 8 MiB writes, write-back started every 32 MiB as the checkpoint writer does,
//! fsync; then reads it); a save by `ranks` threads (write, fsync, commit); an asynchronous
//! save by the same threads, each with an [`AsyncSaver`] kept across rounds (the foreground
//! pause is the slowest rank's; the total runs to the commit); a load by the same row split
//! (`load_same`); and a load by `reshard_ranks` threads with a different row split
//! (`load_reshard`). Each load checks one tensor's bytes against what was written. Before the
//! first round one unreported asynchronous save warms the savers' host buffers (as DCP's
//! benchmark drops its first repetition).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::error::{CkptError, Result};
use crate::{
    AsyncSaver, CheckpointMeta, DType, Piece, RankWriter, Slice, TensorMeta, Verify, commit,
    start_writeback,
};

/// What one benchmark run measures.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Directory to write in (the benchmark removes what it writes).
    pub dir: PathBuf,
    /// Approximate bytes of the checkpoint state and of the plain test files.
    pub size: u64,
    /// Ranks (threads) that save and load with the same split.
    pub ranks: u32,
    /// Ranks of the resharding load.
    pub reshard_ranks: u32,
    /// Rounds to run.
    pub rounds: u32,
    /// Drop the kernel's page cache before every read (root only).
    pub cold: bool,
}

/// A failed I/O operation `op` on `path`.
fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CkptError + 'a {
    move |source| CkptError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// A benchmark failure that is not an I/O error: a check that disagreed, a lost thread.
fn bench_error(reason: String) -> CkptError {
    CkptError::Bench(reason)
}

/// `what` was being done when `e` happened.
fn context(what: String) -> impl FnOnce(CkptError) -> CkptError {
    move |e| CkptError::Bench(format!("{what}: {e}"))
}

/// Writes dirty pages back and empties the page cache, so the next read comes from the disk.
/// Needs root (it writes `/proc/sys/vm/drop_caches`); the error says so.
pub fn drop_caches() -> Result<()> {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").map_err(|e| {
        bench_error(format!(
            "--cold: cannot write /proc/sys/vm/drop_caches ({e}); it needs root"
        ))
    })
}

/// Tensors in the benchmark state.
const TENSORS: usize = 8;
/// Columns of every tensor.
const COLS: u64 = 4096;
/// Bytes per row of one tensor (float32).
const ROW_BYTES: u64 = COLS * 4;
/// Size of each write and read of the plain disk test.
const CHUNK: usize = 8 << 20;
/// The plain disk test starts write-back every this many bytes (as the checkpoint writer does).
const KICK: u64 = 32 << 20;
/// Longest wait for a background save.
const SAVE_TIMEOUT: Duration = Duration::from_secs(600);

/// Figures of one round, in GB/s (10^9 bytes per second).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Round {
    /// The round index.
    pub round: u32,
    /// Bytes of state saved and loaded.
    pub bytes: u64,
    /// Ranks that save and load with the same split.
    pub ranks: u32,
    /// Ranks of the resharding load.
    pub reshard_ranks: u32,
    /// Whether the page cache was dropped before every read.
    pub cold: bool,
    /// The disk's own sequential write bandwidth.
    pub disk_write_gbps: f64,
    /// The disk's own sequential read bandwidth.
    pub disk_read_gbps: f64,
    /// Synchronous save bandwidth (to the commit).
    pub save_gbps: f64,
    /// The slowest rank's foreground pause of the asynchronous save, seconds.
    pub async_pause_s: f64,
    /// Asynchronous save bandwidth, to the commit.
    pub async_total_gbps: f64,
    /// Load bandwidth by the same split.
    pub load_same_gbps: f64,
    /// Load bandwidth by the resharding split.
    pub load_reshard_gbps: f64,
    /// save / disk write.
    pub save_over_disk_write: f64,
    /// load (same split) / disk read.
    pub load_over_disk_read: f64,
    /// reshard load / same-split load.
    pub reshard_over_same: f64,
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-9) / 1e9
}

/// `parts` contiguous row ranges covering `rows`, the first `rows % parts` one row longer.
fn split_rows(rows: u64, parts: u32) -> Vec<(u64, u64)> {
    let (base, extra) = (rows / u64::from(parts), rows % u64::from(parts));
    let mut offset = 0;
    (0..u64::from(parts))
        .map(|i| {
            let len = base + u64::from(i < extra);
            let range = (offset, len);
            offset += len;
            range
        })
        .collect()
}

/// Deterministic contents of rows `first..first + n` of tensor `t`, as little-endian float32.
fn rows_data(t: usize, first: u64, n: u64) -> Vec<u8> {
    let start = first * COLS;
    let mut out = Vec::with_capacity((n * ROW_BYTES) as usize);
    for i in start..start + n * COLS {
        let v = ((t as u64 * 1_000_003 + i) % 1_000_000) as f32;
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn tensor_meta(t: usize, rows: u64) -> TensorMeta {
    TensorMeta {
        name: format!("layer{t}.weight"),
        dtype: DType::F32,
        shape: vec![rows, COLS],
    }
}

/// Writes `bytes` to `path` in [`CHUNK`] writes (write-back started every [`KICK`]) and fsyncs.
fn write_file(path: &Path, bytes: u64) -> Result<()> {
    let chunk: Vec<u8> = (0..CHUNK).map(|i| (i * 31 + 7) as u8).collect();
    let mut file = File::create(path).map_err(io("create", path))?;
    let (mut written, mut kicked) = (0u64, 0u64);
    while written < bytes {
        let n = (bytes - written).min(CHUNK as u64) as usize;
        file.write_all(&chunk[..n]).map_err(io("write", path))?;
        written += n as u64;
        if written - kicked >= KICK {
            start_writeback(&file, kicked, written - kicked);
            kicked = written;
        }
    }
    file.sync_all().map_err(io("fsync", path))
}

/// Reads `path` to the end in [`CHUNK`] reads; checks it holds `bytes` bytes.
fn read_file(path: &Path, bytes: u64) -> Result<()> {
    let mut file = File::open(path).map_err(io("open", path))?;
    let mut buf = vec![0u8; CHUNK];
    let mut read = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io("read", path))?;
        if n == 0 {
            break;
        }
        read += n as u64;
    }
    if read != bytes {
        return Err(bench_error(format!(
            "{}: read back {read} bytes, wrote {bytes}",
            path.display()
        )));
    }
    Ok(())
}

/// Runs `op` on every file of `files` (path, bytes) in its own thread; returns the seconds
/// until the last one finished.
fn timed_parallel(files: &[(PathBuf, u64)], op: fn(&Path, u64) -> Result<()>) -> Result<f64> {
    let start = Instant::now();
    let results = std::thread::scope(|s| {
        let handles = files
            .iter()
            .map(|(path, bytes)| s.spawn(move || op(path, *bytes)))
            .collect();
        join_all(handles)
    });
    let secs = start.elapsed().as_secs_f64();
    results.into_iter().collect::<Result<Vec<()>>>()?;
    Ok(secs)
}

/// The disk's sequential bandwidth with as many streams as the checkpoint has ranks: `streams`
/// threads each write (and fsync) one file of `bytes / streams`, then (after dropping caches if
/// `cold`) read it back. Returns (write seconds, read seconds).
fn disk_round(dir: &Path, bytes: u64, streams: u32, cold: bool) -> Result<(f64, f64)> {
    let per = bytes / u64::from(streams.max(1));
    let files: Vec<(PathBuf, u64)> = (0..streams.max(1))
        .map(|i| (disk_file(dir, i), per))
        .collect();
    let result = timed_parallel(&files, write_file).and_then(|write| {
        if cold {
            drop_caches()?;
        }
        Ok((write, timed_parallel(&files, read_file)?))
    });
    for (path, _) in &files {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// One rank's pieces: its rows of every tensor, and their bytes.
struct RankState {
    slice: Slice,
    bufs: Vec<Vec<u8>>,
}

impl RankState {
    fn pieces<'a>(&'a self, metas: &'a [TensorMeta]) -> Vec<(&'a TensorMeta, &'a Slice, &'a [u8])> {
        metas
            .iter()
            .zip(&self.bufs)
            .map(|(m, b)| (m, &self.slice, b.as_slice()))
            .collect()
    }
}

/// The state of every rank of a `ranks`-way row split, generated before any clock starts (the
/// benchmark measures I/O, not the data generator).
fn rank_states(rows: u64, ranks: u32) -> Vec<RankState> {
    split_rows(rows, ranks)
        .into_iter()
        .map(|(first, n)| RankState {
            slice: Slice::new(&[(first, n), (0, COLS)]),
            bufs: (0..TENSORS).map(|t| rows_data(t, first, n)).collect(),
        })
        .collect()
}

fn bench_meta(rows: u64, ranks: u32, step: u64) -> CheckpointMeta {
    CheckpointMeta {
        run_id: "ckpt-bench".into(),
        world_size: ranks,
        layout: serde_json::json!({"split": "rows", "ranks": ranks}),
        config_hash: "0".into(),
        tensors: (0..TENSORS).map(|t| tensor_meta(t, rows)).collect(),
        state: serde_json::json!({"step": step}),
    }
}

/// Joins scoped threads, turning a panic into an error.
fn join_all<T>(handles: Vec<std::thread::ScopedJoinHandle<'_, Result<T>>>) -> Vec<Result<T>> {
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(bench_error("a bench thread panicked".into())))
        })
        .collect()
}

/// Saves step `step` with one thread per rank; returns the seconds from the first write to the
/// return of `commit`.
fn save(root: &Path, step: u64, rows: u64, states: &[RankState]) -> Result<f64> {
    let metas: Vec<TensorMeta> = (0..TENSORS).map(|t| tensor_meta(t, rows)).collect();
    let start = Instant::now();
    let results = std::thread::scope(|s| {
        let handles = states
            .iter()
            .enumerate()
            .map(|(rank, st)| {
                let metas = &metas;
                s.spawn(move || -> Result<Vec<Piece>> {
                    Ok(RankWriter::write_all(
                        root,
                        step,
                        rank as u32,
                        &st.pieces(metas),
                    )?)
                })
            })
            .collect();
        join_all(handles)
    });
    let mut pieces = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        pieces.extend(r.map_err(context(format!("saving rank {rank} of step {step}")))?);
    }
    let meta = bench_meta(rows, states.len() as u32, step);
    commit(root, step, pieces, meta).map_err(context(format!("committing step {step}")))?;
    Ok(start.elapsed().as_secs_f64())
}

/// Saves step `step` asynchronously: every rank thread hands its state to its saver at once;
/// each background thread sends its piece list to this (coordinator) thread, which commits.
/// Returns (the slowest rank's foreground pause, seconds until the commit returned).
fn save_async(
    root: &Path,
    step: u64,
    rows: u64,
    states: &[RankState],
    savers: &mut [AsyncSaver],
) -> Result<(f64, f64)> {
    let metas: Vec<TensorMeta> = (0..TENSORS).map(|t| tensor_meta(t, rows)).collect();
    let (tx, rx) = mpsc::channel::<Vec<Piece>>();
    let start = Instant::now();
    let pauses = std::thread::scope(|s| {
        let handles = states
            .iter()
            .zip(savers.iter_mut())
            .map(|(st, saver)| {
                let (metas, tx) = (&metas, tx.clone());
                s.spawn(move || -> Result<f64> {
                    let after: crate::AfterWrite = Box::new(move |_, pieces| {
                        // The coordinator may have given up; its error is what gets reported.
                        let _ = tx.send(pieces);
                        Ok(())
                    });
                    Ok(saver.save(step, &st.pieces(metas), after)?.as_secs_f64())
                })
            })
            .collect();
        join_all(handles)
    });
    drop(tx);
    let mut pause = 0f64;
    for (rank, p) in pauses.into_iter().enumerate() {
        pause = pause.max(p.map_err(context(format!("async save of rank {rank}, step {step}")))?);
    }
    let mut pieces = Vec::new();
    for rank in 0..states.len() {
        let got = rx.recv_timeout(SAVE_TIMEOUT);
        pieces.extend(
            got.map_err(|e| bench_error(format!("waiting for rank {rank}'s pieces: {e}")))?,
        );
    }
    let meta = bench_meta(rows, states.len() as u32, step);
    commit(root, step, pieces, meta).map_err(context(format!("committing step {step}")))?;
    let total = start.elapsed().as_secs_f64();
    for (rank, saver) in savers.iter_mut().enumerate() {
        saver
            .wait(SAVE_TIMEOUT)
            .map_err(context(format!("async save of rank {rank}, step {step}")))?;
    }
    Ok((pause, total))
}

/// Loads every tensor of `step` with one thread per row range of a `ranks`-way split, and checks
/// tensor 0 against what was written; returns the seconds taken (open included, check excluded).
fn load(root: &Path, step: u64, rows: u64, ranks: u32) -> Result<f64> {
    let split = split_rows(rows, ranks);
    let start = Instant::now();
    let ckpt = crate::Checkpoint::open(root, step, Verify::ManifestOnly)?;
    let results: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = split
            .iter()
            .map(|&(first, n)| {
                let ckpt = &ckpt;
                s.spawn(move || -> Result<Vec<u8>> {
                    let slice = Slice::new(&[(first, n), (0, COLS)]);
                    let mut first_tensor = Vec::new();
                    for t in 0..TENSORS {
                        let buf = ckpt.read_slice(&tensor_meta(t, rows).name, &slice)?;
                        if t == 0 {
                            first_tensor = buf;
                        }
                    }
                    Ok(first_tensor)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(bench_error("a load thread panicked".into())))
            })
            .collect()
    });
    let secs = start.elapsed().as_secs_f64();
    for (rank, (r, &(first, n))) in results.into_iter().zip(&split).enumerate() {
        let got = r.map_err(context(format!(
            "loading rank {rank} of {ranks} of step {step}"
        )))?;
        if got != rows_data(0, first, n) {
            return Err(bench_error(format!(
                "step {step}: rank {rank} of {ranks} read rows {first}..{} of {:?} that differ \
                 from what was saved",
                first + n,
                tensor_meta(0, rows).name
            )));
        }
    }
    Ok(secs)
}

/// Refuses a `--size` the benchmark cannot hold in memory (the state plus a loaded copy).
fn check_memory(bytes: u64) -> Result<()> {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages > 0 && page > 0 {
        let ram = pages as u64 * page as u64;
        if bytes.saturating_mul(3) > ram {
            return Err(bench_error(format!(
                "--size {bytes} bytes: the benchmark holds about 3x that in memory, this machine \
                 has {ram} bytes"
            )));
        }
    }
    Ok(())
}

/// What every round uses: the ranks' state and their savers (kept across rounds).
struct Bench {
    rows: u64,
    states: Vec<RankState>,
    savers: Vec<AsyncSaver>,
    reshard_ranks: u32,
}

impl Bench {
    fn new(args: &Settings, root: &Path, rows: u64) -> Result<Self> {
        let states = rank_states(rows, args.ranks);
        let mut savers: Vec<AsyncSaver> =
            (0..args.ranks).map(|r| AsyncSaver::new(root, r)).collect();
        // Warm-up (unreported): the first save maps the host buffers.
        save_async(root, 0, rows, &states, &mut savers)?;
        remove_step(root, 0)?;
        Ok(Bench {
            rows,
            states,
            savers,
            reshard_ranks: args.reshard_ranks,
        })
    }
}

fn remove_step(root: &Path, step: u64) -> Result<()> {
    let dir = root.join(crate::step_dir_name(step));
    std::fs::remove_dir_all(&dir).map_err(io("remove", &dir))
}

/// Runs one round, saving steps `2 index + 1` (synchronously) and `2 index + 2` (async).
fn round(args: &Settings, root: &Path, index: u32, bench: &mut Bench) -> Result<Round> {
    let rows = bench.rows;
    let bytes = rows * ROW_BYTES * TENSORS as u64;
    let (w, r) = disk_round(&args.dir, bytes, args.ranks, args.cold)?;
    let step = 2 * u64::from(index) + 1;
    let save_s = save(root, step, rows, &bench.states)?;
    let (pause_s, async_s) = save_async(root, step + 1, rows, &bench.states, &mut bench.savers)?;
    remove_step(root, step + 1)?;
    if args.cold {
        drop_caches()?;
    }
    let same_s = load(root, step, rows, args.ranks)?;
    if args.cold {
        drop_caches()?;
    }
    let reshard_s = load(root, step, rows, bench.reshard_ranks)?;
    remove_step(root, step)?;
    let (dw, dr) = (gbps(bytes, w), gbps(bytes, r));
    let (sv, ls, lr) = (
        gbps(bytes, save_s),
        gbps(bytes, same_s),
        gbps(bytes, reshard_s),
    );
    Ok(Round {
        round: index,
        bytes,
        ranks: args.ranks,
        reshard_ranks: bench.reshard_ranks,
        cold: args.cold,
        disk_write_gbps: dw,
        disk_read_gbps: dr,
        save_gbps: sv,
        async_pause_s: pause_s,
        async_total_gbps: gbps(bytes, async_s),
        load_same_gbps: ls,
        load_reshard_gbps: lr,
        save_over_disk_write: sv / dw,
        load_over_disk_read: ls / dr,
        reshard_over_same: lr / ls,
    })
}

/// Runs the benchmark in `settings.dir`, calling `each` with every round's figures as it ends.
/// Refuses a size too small for the row splits or too large for this machine's memory, and a
/// directory holding a previous run's leftovers; removes what it wrote, also on an error.
pub fn run(settings: &Settings, each: &mut dyn FnMut(&Round) -> Result<()>) -> Result<()> {
    let (ranks, reshard) = (settings.ranks, settings.reshard_ranks);
    let rows = settings.size / (ROW_BYTES * TENSORS as u64);
    let most = u64::from(ranks.max(reshard));
    if rows < most {
        return Err(bench_error(format!(
            "--size {} bytes is too small: {} tensors of [rows, {COLS}] float32 need at least \
             {most} rows ({} bytes) for {ranks} ranks and a reshard load by {reshard}",
            settings.size,
            TENSORS,
            most * ROW_BYTES * TENSORS as u64,
        )));
    }
    check_memory(settings.size)?;
    let root = settings.dir.join("ckpt-bench-root");
    if root.exists() {
        return Err(bench_error(format!(
            "{} already exists (left by an interrupted run?); remove it or choose another --dir",
            root.display()
        )));
    }
    std::fs::create_dir_all(&root).map_err(io("create", &root))?;
    let result = Bench::new(settings, &root, rows).and_then(|mut bench| {
        (0..settings.rounds).try_for_each(|index| each(&round(settings, &root, index, &mut bench)?))
    });
    if result.is_err() {
        // Best effort: the error being returned matters more than a failed cleanup.
        let _ = std::fs::remove_dir_all(&root);
        return result;
    }
    std::fs::remove_dir(&root).map_err(io("remove", &root))
}

/// Plain test file `index` of [`disk_round`].
fn disk_file(dir: &Path, index: u32) -> PathBuf {
    dir.join(format!("ckpt-bench-disk-{index}.bin"))
}
