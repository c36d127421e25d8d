//! `flotilla ckpt bench`: checkpoint save and load bandwidth against the disk's own sequential
//! write and read bandwidth, measured in the same round on the same directory.
//!
//! The state is 8 float32 tensors of shape `[rows, 4096]` (rows chosen so the total is about
//! `--size`), split by rows across ranks. Each round measures, in order: a plain file write
//! (8 MiB writes, fsync) and read; a save by `--ranks` threads (write, fsync, commit); a load by
//! the same row split (`load_same`); and a load by `--ranks + 1` threads with a different row
//! split (`load_reshard`). Each load checks one tensor's bytes against what was written.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use ckpt::{CheckpointMeta, DType, Piece, RankWriter, Slice, TensorMeta, Verify, commit};
use data::prepare::parse_byte_size;

use crate::page_cache::drop_caches;

/// Tensors in the benchmark state.
const TENSORS: usize = 8;
/// Columns of every tensor.
const COLS: u64 = 4096;
/// Bytes per row of one tensor (float32).
const ROW_BYTES: u64 = COLS * 4;
/// Size of each write and read of the plain disk test.
const CHUNK: usize = 8 << 20;

/// Options of `flotilla ckpt bench`.
#[derive(clap::Args)]
pub struct Args {
    /// Directory to write in (created if missing; the benchmark removes what it writes).
    #[arg(long)]
    pub dir: PathBuf,
    /// Approximate size of the checkpoint state and of the plain test file (e.g. 1GiB, 64MiB).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub size: u64,
    /// Ranks (threads) that save and load with the same layout; the reshard load uses one more.
    #[arg(long, default_value_t = 2)]
    pub ranks: u32,
    /// Rounds to run.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Cold page cache: drop the kernel's caches before every read (root only: writes
    /// /proc/sys/vm/drop_caches).
    #[arg(long)]
    pub cold: bool,
    /// Print one JSON object per round instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_size(s: &str) -> Result<u64, data::DataError> {
    parse_byte_size("--size", s)
}

/// Figures of one round, in GB/s (10^9 bytes per second).
#[derive(serde::Serialize)]
struct Round {
    round: u32,
    bytes: u64,
    ranks: u32,
    reshard_ranks: u32,
    cold: bool,
    disk_write_gbps: f64,
    disk_read_gbps: f64,
    save_gbps: f64,
    load_same_gbps: f64,
    load_reshard_gbps: f64,
    save_over_disk_write: f64,
    load_over_disk_read: f64,
    reshard_over_same: f64,
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

/// Writes `bytes` to `path` in [`CHUNK`] writes, fsyncs, then (after dropping caches if `cold`)
/// reads it back; returns (write seconds, read seconds).
fn disk_round(path: &Path, bytes: u64, cold: bool) -> Result<(f64, f64)> {
    let chunk: Vec<u8> = (0..CHUNK).map(|i| (i * 31 + 7) as u8).collect();
    let start = Instant::now();
    let mut file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(CHUNK as u64) as usize;
        file.write_all(&chunk[..n])
            .with_context(|| format!("writing {}", path.display()))?;
        left -= n as u64;
    }
    file.sync_all()
        .with_context(|| format!("fsync {}", path.display()))?;
    drop(file);
    let write = start.elapsed().as_secs_f64();
    if cold {
        drop_caches()?;
    }
    let start = Instant::now();
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut buf = vec![0u8; CHUNK];
    let mut read = 0u64;
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        read += n as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    if read != bytes {
        bail!("{}: read back {read} bytes, wrote {bytes}", path.display());
    }
    std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
    Ok((write, secs))
}

/// Saves step `step` with one thread per row range; returns the seconds from the first write to
/// the return of `commit`.
fn save(root: &Path, step: u64, rows: u64, ranks: u32) -> Result<f64> {
    let split = split_rows(rows, ranks);
    // Generated before the clock starts: the benchmark measures I/O, not the data generator.
    let data: Vec<Vec<Vec<u8>>> = split
        .iter()
        .map(|&(first, n)| (0..TENSORS).map(|t| rows_data(t, first, n)).collect())
        .collect();
    let start = Instant::now();
    let results: Vec<Result<Vec<Piece>>> = std::thread::scope(|s| {
        let handles: Vec<_> = split
            .iter()
            .zip(&data)
            .enumerate()
            .map(|(rank, (&(first, n), bufs))| {
                s.spawn(move || -> Result<Vec<Piece>> {
                    let mut w = RankWriter::create(root, step, rank as u32)?;
                    for (t, buf) in bufs.iter().enumerate() {
                        let slice = Slice::new(&[(first, n), (0, COLS)]);
                        w.write_piece(&tensor_meta(t, rows), &slice, buf)?;
                    }
                    Ok(w.finish()?)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("a save thread panicked")))
            })
            .collect()
    });
    let mut pieces = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        pieces.extend(r.with_context(|| format!("saving rank {rank} of step {step}"))?);
    }
    let meta = CheckpointMeta {
        run_id: "ckpt-bench".into(),
        world_size: ranks,
        layout: serde_json::json!({"split": "rows", "ranks": ranks}),
        config_hash: "0".into(),
        tensors: (0..TENSORS).map(|t| tensor_meta(t, rows)).collect(),
        state: serde_json::json!({"step": step}),
    };
    commit(root, step, pieces, meta).with_context(|| format!("committing step {step}"))?;
    Ok(start.elapsed().as_secs_f64())
}

/// Loads every tensor of `step` with one thread per row range of a `ranks`-way split, and checks
/// tensor 0 against what was written; returns the seconds taken (open included, check excluded).
fn load(root: &Path, step: u64, rows: u64, ranks: u32) -> Result<f64> {
    let split = split_rows(rows, ranks);
    let start = Instant::now();
    let ckpt = ckpt::Checkpoint::open(root, step, Verify::ManifestOnly)?;
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
                    .unwrap_or_else(|_| Err(anyhow!("a load thread panicked")))
            })
            .collect()
    });
    let secs = start.elapsed().as_secs_f64();
    for (rank, (r, &(first, n))) in results.into_iter().zip(&split).enumerate() {
        let got = r.with_context(|| format!("loading rank {rank} of {ranks} of step {step}"))?;
        if got != rows_data(0, first, n) {
            bail!(
                "step {step}: rank {rank} of {ranks} read rows {first}..{} of {:?} that differ \
                 from what was saved",
                first + n,
                tensor_meta(0, rows).name
            );
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
            bail!(
                "--size {bytes} bytes: the benchmark holds about 3x that in memory, this machine has {ram} bytes"
            );
        }
    }
    Ok(())
}

/// Runs one round, saving step `index`.
fn round(args: &Args, root: &Path, index: u32, rows: u64) -> Result<Round> {
    let bytes = rows * ROW_BYTES * TENSORS as u64;
    let (w, r) = disk_round(&disk_file(&args.dir), bytes, args.cold)?;
    let step = u64::from(index);
    let save_s = save(root, step, rows, args.ranks)?;
    if args.cold {
        drop_caches()?;
    }
    let same_s = load(root, step, rows, args.ranks)?;
    if args.cold {
        drop_caches()?;
    }
    let reshard_s = load(root, step, rows, args.ranks + 1)?;
    let dir = root.join(ckpt::step_dir_name(step));
    std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
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
        reshard_ranks: args.ranks + 1,
        cold: args.cold,
        disk_write_gbps: dw,
        disk_read_gbps: dr,
        save_gbps: sv,
        load_same_gbps: ls,
        load_reshard_gbps: lr,
        save_over_disk_write: sv / dw,
        load_over_disk_read: ls / dr,
        reshard_over_same: lr / ls,
    })
}

/// Runs the benchmark and prints one line (or JSON object) per round.
pub fn run(args: Args) -> Result<()> {
    if args.ranks == 0 || args.rounds == 0 {
        bail!(
            "--ranks {} and --rounds {} must be at least 1",
            args.ranks,
            args.rounds
        );
    }
    let rows = args.size / (ROW_BYTES * TENSORS as u64);
    if rows < u64::from(args.ranks) + 1 {
        bail!(
            "--size {} bytes is too small: {} tensors of [rows, {COLS}] float32 need at least {} \
             rows ({} bytes) for {} ranks and the reshard load",
            args.size,
            TENSORS,
            args.ranks + 1,
            (u64::from(args.ranks) + 1) * ROW_BYTES * TENSORS as u64,
            args.ranks
        );
    }
    check_memory(args.size)?;
    let root = args.dir.join("ckpt-bench-root");
    if root.exists() {
        bail!(
            "{} already exists (left by an interrupted run?); remove it or choose another --dir",
            root.display()
        );
    }
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    if !args.json {
        println!(
            "{:>5} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>12}",
            "round",
            "bytes",
            "disk_w",
            "disk_r",
            "save",
            "load",
            "reshard",
            "save/disk",
            "load/disk",
            "reshard/load"
        );
        println!(
            "{:>5} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9}   (GB/s; save and load by {} ranks, reshard load by {}{})",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            args.ranks,
            args.ranks + 1,
            if args.cold { ", cold cache" } else { "" }
        );
    }
    let result = (0..args.rounds).try_for_each(|index| print_round(&args, &root, index, rows));
    if result.is_err() {
        // Best effort: the error being returned matters more than a failed cleanup.
        let _ = std::fs::remove_dir_all(&root);
        let _ = std::fs::remove_file(disk_file(&args.dir));
        return result;
    }
    std::fs::remove_dir(&root).with_context(|| format!("removing {}", root.display()))
}

/// The plain test file of [`disk_round`].
fn disk_file(dir: &Path) -> PathBuf {
    dir.join("ckpt-bench-disk.bin")
}

/// Runs one round and prints its line (or JSON object).
fn print_round(args: &Args, root: &Path, index: u32, rows: u64) -> Result<()> {
    let r = round(args, root, index, rows)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{:>5} {:>12} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>9.2} {:>12.2}",
            r.round,
            r.bytes,
            r.disk_write_gbps,
            r.disk_read_gbps,
            r.save_gbps,
            r.load_same_gbps,
            r.load_reshard_gbps,
            r.save_over_disk_write,
            r.load_over_disk_read,
            r.reshard_over_same
        );
    }
    Ok(())
}
