//! Per-step training metrics as JSON lines, and a final summary line.
//!
//! One [`Record`] per line, tagged by `"kind"`:
//!
//! ```text
//! {"kind":"step","step":1,"loss":9.01,...,"comm_s":0.0,"data_s":0.0004,"ckpt_pause_s":null,...}
//! {"kind":"summary","steps":50,"final_loss":5.2,"tokens_per_s":41000.0,"mfu":0.31,...}
//! ```
//!
//! Times are seconds. A step's wall time splits as `step_s` (forward, backward, optimizer:
//! `compute_s` plus the exposed communication `comm_s`) plus the batch wait `data_s`, plus
//! `ckpt_pause_s` when the step saved a checkpoint. Non-finite numbers (a diverged loss)
//! are written as `null` and read back as NaN.
//!
//! [`MetricsLog`] appends to its file and flushes every line, so a killed run loses at most
//! the line being written; the next run cuts such a torn line off before appending, and
//! [`read_records`] skips one at the end of a file.
use crate::metrics::mfu;
use crate::trainer::StepStats;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What went wrong writing or reading a metrics file.
#[derive(Debug, thiserror::Error)]
pub enum MetricsLogError {
    /// The file could not be created, written or read.
    #[error("metrics file {}: {source}", path.display())]
    Io {
        /// The metrics file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// A line of the file is not a metrics record.
    #[error("metrics file {}, line {line}: {source}", path.display())]
    BadLine {
        /// The metrics file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// Why it does not parse.
        source: serde_json::Error,
    },
}

type Result<T, E = MetricsLogError> = std::result::Result<T, E>;

/// One line of a metrics file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Record {
    /// One optimizer step.
    Step(StepRecord),
    /// The run's totals, written last.
    Summary(Summary),
    /// A rank named slow ([`crate::straggler`]).
    Straggler(StragglerRecord),
    /// The job's goodput ledger, written by the launcher at the end ([`crate::goodput`]).
    Goodput(crate::goodput::Ledger),
}

/// Appends `r` as one line to the metrics file `path` (which must exist: the run made it).
pub fn append_record(path: &Path, r: &Record) -> Result<()> {
    let io = |source| MetricsLogError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut line = serde_json::to_vec(r).map_err(|e| io(e.into()))?;
    line.push(b'\n');
    let mut f = OpenOptions::new().append(true).open(path).map_err(io)?;
    f.write_all(&line).map_err(io)
}

/// A straggler named during the run (`{"kind":"straggler","rank":1,"slowdown":3.02,...}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StragglerRecord {
    /// The step at which it was named.
    pub step: u64,
    /// The slow rank.
    pub rank: usize,
    /// How many times the other ranks' median arrival time it took.
    pub slowdown: f64,
    /// Its arrival time at that step, seconds.
    pub arrival_s: f64,
    /// The other ranks' median arrival time at that step, seconds.
    pub others_s: f64,
    /// Restart generation of the job.
    pub generation: u64,
}

/// What a run is, for every record: the same on every step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunInfo {
    /// This process's data-parallel rank.
    pub rank: usize,
    /// Data-parallel processes.
    pub world: usize,
    /// Restart generation of the job (0 for a first run).
    pub generation: u64,
    /// MFU denominator of the whole job (all ranks together), GFLOP/s.
    pub peak_gflops: f64,
    /// Model FLOPs per trained token (`Trainer::flops_per_token`).
    pub flops_per_token: f64,
}

/// One optimizer step's metrics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Steps completed, counting this one (1-based).
    pub step: u64,
    /// Mean cross-entropy of the step's batch (nats/token).
    #[serde(with = "nullable")]
    pub loss: f64,
    /// Held-out validation loss measured after this step (`--eval-every`), if it was due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Learning rate used.
    #[serde(with = "nullable")]
    pub lr: f32,
    /// Global gradient norm before clipping.
    #[serde(with = "nullable")]
    pub grad_norm: f64,
    /// Tokens trained in this step, all ranks together.
    pub tokens: u64,
    /// `tokens / step_s`.
    #[serde(with = "nullable")]
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation (a fraction) against the job's peak.
    #[serde(with = "nullable")]
    pub mfu: f64,
    /// Wall time of the step, batch wait excluded.
    pub step_s: f64,
    /// The part of `step_s` not waiting for communication.
    pub compute_s: f64,
    /// Exposed communication: the wait for gradients after the backward (0 for one process).
    pub comm_s: f64,
    /// Data stall: the wait for the step's batch.
    pub data_s: f64,
    /// Training paused for a checkpoint save after this step, if one was taken.
    pub ckpt_pause_s: Option<f64>,
    /// This process's data-parallel rank.
    pub rank: usize,
    /// Data-parallel processes.
    pub world: usize,
    /// Restart generation of the job.
    pub generation: u64,
    /// When the record was made, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// Under per-step fault tolerance (`--ft`): attempts of this step that failed on a lost
    /// replica and were trained again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retried: Option<u64>,
    /// Under `--ft`: the time those attempts and the waits for their quorums took, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retried_s: Option<f64>,
    /// Under `--ft`: replica groups that trained this step (of `world` ranks' groups).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<usize>,
}

impl StepRecord {
    /// The record of step `s` of the run `run`; `ckpt_pause` is the training pause of a
    /// checkpoint taken at this step.
    pub fn new(s: &StepStats, run: &RunInfo, ckpt_pause: Option<Duration>) -> Self {
        let tokens_per_s = s.tokens as f64 / s.seconds;
        Self {
            step: s.step,
            loss: s.loss,
            val_loss: None,
            lr: s.lr,
            grad_norm: s.grad_norm,
            tokens: s.tokens as u64,
            tokens_per_s,
            mfu: mfu(tokens_per_s, run.flops_per_token, run.peak_gflops),
            step_s: s.seconds,
            compute_s: (s.seconds - s.comm_seconds).max(0.0),
            comm_s: s.comm_seconds,
            data_s: s.data_seconds,
            ckpt_pause_s: ckpt_pause.map(|d| d.as_secs_f64()),
            rank: run.rank,
            world: run.world,
            generation: run.generation,
            unix_ms: unix_ms(),
            retried: None,
            retried_s: None,
            replicas: None,
        }
    }
}

/// A run's totals over the steps it logged.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Steps logged.
    pub steps: u64,
    /// The last step's number (the run's step count, resumed steps included).
    pub last_step: u64,
    /// The last step's loss.
    #[serde(with = "nullable")]
    pub final_loss: f64,
    /// Tokens trained, all ranks together.
    pub tokens: u64,
    /// Tokens per second of step time over the steps after the first (which warms caches;
    /// a one-step run counts it).
    #[serde(with = "nullable")]
    pub tokens_per_s: f64,
    /// MFU of `tokens_per_s`, a fraction.
    #[serde(with = "nullable")]
    pub mfu: f64,
    /// Exposed communication as a percentage of step time.
    #[serde(with = "nullable")]
    pub comm_pct: f64,
    /// Data stall as a percentage of step time plus stall (000 eq. 4.2 on the sums).
    #[serde(with = "nullable")]
    pub data_stall_pct: f64,
    /// Checkpoints taken.
    pub ckpt_count: u64,
    /// Training paused for checkpoints, in total.
    pub ckpt_pause_total_s: f64,
    /// The longest checkpoint pause (0 without checkpoints).
    pub ckpt_pause_max_s: f64,
    /// Wall time from opening the log to the summary.
    pub wall_s: f64,
    /// This process's data-parallel rank.
    pub rank: usize,
    /// Data-parallel processes.
    pub world: usize,
    /// Restart generation of the job.
    pub generation: u64,
    /// When the summary was made, milliseconds since the Unix epoch.
    pub unix_ms: u64,
}

/// Running totals from which a [`Summary`] is made.
#[derive(Clone, Debug, Default)]
struct Totals {
    steps: u64,
    last: Option<(u64, f64)>,
    tokens: u64,
    timed: (u64, f64, f64),
    step_s: f64,
    comm_s: f64,
    data_s: f64,
    ckpt: (u64, f64, f64),
}

impl Totals {
    fn add(&mut self, r: &StepRecord) {
        // The first logged step is left out of the rate once a second one arrives.
        if self.steps == 1 {
            self.timed = (0, 0.0, 0.0);
        }
        self.steps += 1;
        self.last = Some((r.step, r.loss));
        self.tokens += r.tokens;
        self.timed.0 += r.tokens;
        self.timed.1 += r.step_s;
        self.timed.2 += r.mfu * r.step_s;
        self.step_s += r.step_s;
        self.comm_s += r.comm_s;
        self.data_s += r.data_s;
        if let Some(p) = r.ckpt_pause_s {
            self.ckpt.0 += 1;
            self.ckpt.1 += p;
            self.ckpt.2 = self.ckpt.2.max(p);
        }
    }

    fn summary(&self, run: &RunInfo, wall: Duration) -> Summary {
        let pct = |part: f64, whole: f64| {
            if whole > 0.0 {
                100.0 * part / whole
            } else {
                0.0
            }
        };
        let (last_step, final_loss) = self.last.unwrap_or((0, f64::NAN));
        let (timed_tokens, timed_s, mfu_s) = self.timed;
        Summary {
            steps: self.steps,
            last_step,
            final_loss,
            tokens: self.tokens,
            tokens_per_s: if timed_s > 0.0 {
                timed_tokens as f64 / timed_s
            } else {
                0.0
            },
            // Step-time-weighted MFU: the MFU of the mean rate.
            mfu: if timed_s > 0.0 { mfu_s / timed_s } else { 0.0 },
            comm_pct: pct(self.comm_s, self.step_s),
            data_stall_pct: pct(self.data_s, self.step_s + self.data_s),
            ckpt_count: self.ckpt.0,
            ckpt_pause_total_s: self.ckpt.1,
            ckpt_pause_max_s: self.ckpt.2,
            wall_s: wall.as_secs_f64(),
            rank: run.rank,
            world: run.world,
            generation: run.generation,
            unix_ms: unix_ms(),
        }
    }
}

/// An open metrics file: one JSON line per step, then a summary.
pub struct MetricsLog {
    path: PathBuf,
    out: BufWriter<File>,
    run: RunInfo,
    totals: Totals,
    opened: Instant,
}

impl MetricsLog {
    /// Opens `path` for appending (creating it and its parent directories), first cutting
    /// off a torn final line left by a killed run.
    pub fn open(path: &Path, run: RunInfo) -> Result<Self> {
        let io = |source| MetricsLogError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        let keep = complete_len(&mut file).map_err(io)?;
        file.set_len(keep).map_err(io)?;
        file.seek(SeekFrom::Start(keep)).map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
            run,
            totals: Totals::default(),
            opened: Instant::now(),
        })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the record of step `s` (see [`StepRecord::new`]) and returns it.
    pub fn step(&mut self, s: &StepStats, ckpt_pause: Option<Duration>) -> Result<StepRecord> {
        let r = StepRecord::new(s, &self.run, ckpt_pause);
        self.write_step(&r)?;
        Ok(r)
    }

    /// Writes a step record made elsewhere, counting it in the summary.
    pub fn write_step(&mut self, r: &StepRecord) -> Result<()> {
        self.totals.add(r);
        self.write(&Record::Step(r.clone()))
    }

    /// Writes the record of a straggler named at this point of the run.
    pub fn straggler(&mut self, st: &crate::straggler::Straggler) -> Result<()> {
        self.write(&Record::Straggler(StragglerRecord {
            step: st.step,
            rank: st.rank,
            slowdown: st.slowdown,
            arrival_s: st.arrival_s,
            others_s: st.others_s,
            generation: self.run.generation,
        }))
    }

    /// The summary of the steps written so far, timed from [`MetricsLog::open`].
    pub fn summary(&self) -> Summary {
        self.totals.summary(&self.run, self.opened.elapsed())
    }

    /// Writes the summary line and returns it.
    pub fn finish(mut self) -> Result<Summary> {
        let s = self.summary();
        self.write(&Record::Summary(s.clone()))?;
        Ok(s)
    }

    /// Writes one line and flushes it to the file.
    fn write(&mut self, r: &Record) -> Result<()> {
        let mut line = serde_json::to_vec(r).map_err(|e| MetricsLogError::Io {
            path: self.path.clone(),
            source: e.into(),
        })?;
        line.push(b'\n');
        self.out
            .write_all(&line)
            .and_then(|()| self.out.flush())
            .map_err(|source| MetricsLogError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

/// Reads the records of the metrics file `path`, skipping a torn (unterminated, unparsable)
/// last line; any other bad line is an error naming its line number.
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    let io = |source| MetricsLogError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = BufReader::new(File::open(path).map_err(io)?);
    let mut records = Vec::new();
    let mut line = String::new();
    for n in 1.. {
        line.clear();
        if reader.read_line(&mut line).map_err(io)? == 0 {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(&line) {
            Ok(r) => records.push(r),
            Err(_) if !line.ends_with('\n') => break,
            Err(source) => {
                return Err(MetricsLogError::BadLine {
                    path: path.to_path_buf(),
                    line: n,
                    source,
                });
            }
        }
    }
    Ok(records)
}

/// The length of `file` up to and including its last newline (0 if it has none).
fn complete_len(file: &mut File) -> io::Result<u64> {
    let len = file.metadata()?.len();
    let mut end = len;
    let mut buf = vec![0u8; 64 << 10];
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let chunk = &mut buf[..(end - start) as usize];
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(chunk)?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Float fields written as `null` when not finite (JSON has no NaN), read back as NaN.
mod nullable {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// `f32` and `f64`.
    pub trait Float: Copy + Serialize + for<'de> Deserialize<'de> {
        const NAN: Self;
        fn finite(self) -> bool;
    }

    impl Float for f32 {
        const NAN: Self = f32::NAN;
        fn finite(self) -> bool {
            self.is_finite()
        }
    }

    impl Float for f64 {
        const NAN: Self = f64::NAN;
        fn finite(self) -> bool {
            self.is_finite()
        }
    }

    pub fn serialize<F: Float, S: Serializer>(v: &F, s: S) -> Result<S::Ok, S::Error> {
        if v.finite() {
            v.serialize(s)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, F: Float, D: Deserializer<'de>>(d: D) -> Result<F, D::Error> {
        Ok(Option::<F>::deserialize(d)?.unwrap_or(F::NAN))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUN: RunInfo = RunInfo {
        rank: 0,
        world: 2,
        generation: 3,
        peak_gflops: 100.0,
        flops_per_token: 1e6,
    };

    fn stats(step: u64, loss: f64) -> StepStats {
        StepStats {
            step,
            loss,
            lr: 1e-3,
            grad_norm: 0.5,
            tokens: 1000,
            seconds: 0.1,
            data_seconds: 0.025,
            comm_seconds: 0.02,
        }
    }

    #[test]
    fn steps_and_summary_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/a/metrics.jsonl");
        let mut log = MetricsLog::open(&path, RUN).unwrap();
        let first = log.step(&stats(1, 9.0), None).unwrap();
        log.step(&stats(2, f64::NAN), Some(Duration::from_millis(30)))
            .unwrap();
        log.step(&stats(3, 7.0), Some(Duration::from_millis(10)))
            .unwrap();
        let summary = log.finish().unwrap();
        let records = read_records(&path).unwrap();
        assert_eq!(records.len(), 4);
        assert_eq!(records[0], Record::Step(first.clone()));
        assert_eq!(records[3], Record::Summary(summary.clone()));
        let Record::Step(nan) = &records[1] else {
            panic!("{records:?}")
        };
        assert!(nan.loss.is_nan() && nan.ckpt_pause_s == Some(0.03));

        // 1000 tokens in 0.1 s at 1 MFLOP/token against 100 GFLOP/s: 10 % MFU.
        assert!((first.tokens_per_s - 1e4).abs() < 1e-6);
        assert!((first.mfu - 0.1).abs() < 1e-9);
        assert!((first.compute_s - 0.08).abs() < 1e-12);
        assert_eq!((first.rank, first.world, first.generation), (0, 2, 3));
        // Totals: steps 2 and 3 timed; comm 0.02 of 0.1; stall 0.025 of 0.125.
        assert_eq!(
            (summary.steps, summary.last_step, summary.tokens),
            (3, 3, 3000)
        );
        assert_eq!(summary.final_loss, 7.0);
        assert!((summary.tokens_per_s - 1e4).abs() < 1e-6);
        assert!((summary.mfu - 0.1).abs() < 1e-9);
        assert!((summary.comm_pct - 20.0).abs() < 1e-9);
        assert!((summary.data_stall_pct - 20.0).abs() < 1e-9);
        assert_eq!(summary.ckpt_count, 2);
        assert!((summary.ckpt_pause_total_s - 0.04).abs() < 1e-12);
        assert_eq!(summary.ckpt_pause_max_s, 0.03);

        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("{\"kind\":\"step\",\"step\":1,"), "{text}");
        assert!(text.contains("\"loss\":null"), "{text}");
        assert!(
            text.contains("\"lr\":0.001,"),
            "f32 printed as such: {text}"
        );
        assert!(
            text.lines()
                .last()
                .unwrap()
                .starts_with("{\"kind\":\"summary\"")
        );
    }

    #[test]
    fn a_torn_last_line_is_skipped_then_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let mut log = MetricsLog::open(&path, RUN).unwrap();
        log.step(&stats(1, 9.0), None).unwrap();
        drop(log);
        // A run killed mid-line.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"kind\":\"step\",\"step\":2,\"lo").unwrap();
        drop(f);
        assert_eq!(read_records(&path).unwrap().len(), 1);
        // The resumed run appends after the last whole line.
        let mut log = MetricsLog::open(&path, RUN).unwrap();
        log.step(&stats(2, 8.0), None).unwrap();
        log.finish().unwrap();
        let records = read_records(&path).unwrap();
        assert_eq!(records.len(), 3);
        assert!(matches!(&records[1], Record::Step(s) if s.step == 2));
        // A file that is one torn line becomes empty.
        std::fs::write(&path, "{\"kind\":").unwrap();
        drop(MetricsLog::open(&path, RUN).unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), b"");
    }

    #[test]
    fn a_bad_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let mut log = MetricsLog::open(&path, RUN).unwrap();
        log.step(&stats(1, 9.0), None).unwrap();
        drop(log);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"\nnot json\n{\"kind\":\"other\"}\n").unwrap();
        drop(f);
        let e = read_records(&path).unwrap_err().to_string();
        assert!(e.contains("m.jsonl") && e.contains("line 3"), "{e}");
        let e = read_records(&dir.path().join("none.jsonl")).unwrap_err();
        assert!(e.to_string().contains("none.jsonl"), "{e}");
    }

    #[test]
    fn an_unwritable_path_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "").unwrap();
        let e = MetricsLog::open(&file.join("m.jsonl"), RUN).err().unwrap();
        assert!(e.to_string().contains("m.jsonl"), "{e}");
    }

    #[test]
    fn an_empty_log_summarises_to_zeros() {
        let s = Totals::default().summary(&RUN, Duration::ZERO);
        assert_eq!((s.steps, s.tokens, s.ckpt_count), (0, 0, 0));
        assert!(s.final_loss.is_nan() && s.tokens_per_s == 0.0 && s.mfu == 0.0);
    }
}
