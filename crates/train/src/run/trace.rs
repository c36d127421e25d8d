//! `--trace DIR`: a Chrome / Perfetto trace per rank (`DIR/rank-R.json`, `rank-R.gG.json` after
//! a restart), in the Trace Event Format's JSON object form: open it in `ui.perfetto.dev` or
//! `chrome://tracing`.
//!
//! Events (complete events, `"ph":"X"`, microseconds from the rank's start; process = rank):
//! - `step N` (category `step`): the step from its start to the end of its checkpoint;
//! - `data wait` (`data`): the wait for the step's batch, at the step's start;
//! - `compute` (`compute`): the rest of the step (forward, backward, optimizer, with the
//!   communication the engine waits for inside it);
//! - one event per collective or point-to-point op (`comm`), named by the op (`all_reduce`,
//!   `send`, ...) with its group, bytes and algorithm, on the thread that ran it
//!   ([`comm::trace`]);
//! - `checkpoint copy` (`checkpoint`): the training pause of a save, ending where the step's
//!   saving ended.
//!
//! Events are written as each step ends (memory stays bounded); the array is closed when the
//! run ends, so a killed rank leaves a file that Perfetto still opens (the format allows an
//! unterminated array).
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::error::{Result, TrainError};
use crate::trainer::StepStats;

/// One rank's trace file being written.
pub(super) struct Tracer {
    path: PathBuf,
    out: BufWriter<File>,
    rank: usize,
    epoch: Instant,
    threads: HashMap<String, usize>,
}

impl Tracer {
    /// Starts the trace of `rank` in `generation` in `dir` (created), and turns on the
    /// recording of this process's communication ops.
    pub(super) fn start(dir: &Path, rank: usize, generation: u64) -> Result<Tracer> {
        let name = match generation {
            0 => format!("rank-{rank}.json"),
            g => format!("rank-{rank}.g{g}.json"),
        };
        let path = dir.join(name);
        let io = |source| TrainError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let file = File::create(&path).map_err(io)?;
        comm::trace::enable();
        // Ops before the first step (joining, resuming) are not on the timeline.
        comm::trace::take();
        let mut t = Tracer {
            out: BufWriter::new(file),
            path: path.clone(),
            rank,
            epoch: Instant::now(),
            threads: HashMap::new(),
        };
        t.out
            .write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n")
            .map_err(io)?;
        let meta = json!({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
            "args": {"name": format!("rank {rank}")}});
        t.write(&meta, false)?;
        Ok(t)
    }

    /// The events of step `s`, which started at `began`, and of its checkpoint pause if it
    /// saved, and the ops recorded meanwhile.
    pub(super) fn step(
        &mut self,
        s: &StepStats,
        began: Instant,
        pause: Option<Duration>,
    ) -> Result<()> {
        let end = Instant::now();
        let main = self.tid("main")?;
        let data_end = began + Duration::from_secs_f64(s.data_seconds.max(0.0));
        let args = json!({"loss": s.loss, "tokens": s.tokens, "comm_s": s.comm_seconds});
        self.span(&format!("step {}", s.step), "step", main, began, end, args)?;
        self.span(
            "data wait",
            "data",
            main,
            began,
            data_end.min(end),
            json!({}),
        )?;
        let compute_end = match pause {
            Some(p) => end.checked_sub(p).unwrap_or(end).max(data_end),
            None => end,
        };
        self.span(
            "compute",
            "compute",
            main,
            data_end.min(end),
            compute_end,
            json!({}),
        )?;
        if let Some(p) = pause {
            let ms = p.as_secs_f64() * 1e3;
            self.span(
                "checkpoint copy",
                "checkpoint",
                main,
                compute_end,
                end,
                json!({"pause_ms": ms}),
            )?;
        }
        let (ops, dropped) = comm::trace::take();
        for op in ops {
            let tid = self.tid(&op.thread)?;
            let args = json!({"group": op.group, "bytes": op.bytes, "algo": op.algo});
            self.span(op.kind, "comm", tid, op.start, op.start + op.dur, args)?;
        }
        if dropped > 0 {
            let ev = json!({"name": "ops dropped", "ph": "i", "s": "p", "pid": self.rank,
                "tid": main, "ts": self.us(end), "args": {"dropped": dropped}});
            self.write(&ev, true)?;
        }
        self.out.flush().map_err(|source| TrainError::Io {
            path: self.path.clone(),
            source,
        })
    }

    /// Closes the event array; the file's path.
    pub(super) fn finish(mut self) -> Result<PathBuf> {
        let io = |source| TrainError::Io {
            path: self.path.clone(),
            source,
        };
        self.out.write_all(b"\n]}\n").map_err(io)?;
        self.out.flush().map_err(io)?;
        Ok(self.path)
    }

    /// The thread id of `name`, declared (`thread_name`) the first time.
    fn tid(&mut self, name: &str) -> Result<usize> {
        if let Some(&t) = self.threads.get(name) {
            return Ok(t);
        }
        let t = self.threads.len();
        self.threads.insert(name.to_string(), t);
        let meta = json!({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": t,
            "args": {"name": name}});
        self.write(&meta, true)?;
        Ok(t)
    }

    fn us(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.epoch).as_secs_f64() * 1e6
    }

    /// A complete event from `from` to `to`.
    fn span(
        &mut self,
        name: &str,
        cat: &str,
        tid: usize,
        from: Instant,
        to: Instant,
        args: Value,
    ) -> Result<()> {
        let ts = self.us(from);
        let dur = (self.us(to) - ts).max(0.0);
        let ev = json!({"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid,
            "ts": ts, "dur": dur, "args": args});
        self.write(&ev, true)
    }

    fn write(&mut self, ev: &Value, comma: bool) -> Result<()> {
        let mut line = if comma { b",\n".to_vec() } else { vec![] };
        line.extend(serde_json::to_vec(ev).unwrap_or_default());
        self.out.write_all(&line).map_err(|source| TrainError::Io {
            path: self.path.clone(),
            source,
        })
    }
}
