//! The job's live figures for `flotilla train --metrics-port` (a Prometheus endpoint served by
//! the launcher, [`crate::http`]).
//!
//! Each worker keeps its running [`RankFigures`] (the last step's figures and the totals of
//! its generation) and a [`Publisher`] thread puts them, as JSON, in the rendezvous store under
//! [`key`]`(generation, rank)` after every step (the latest only: a slow store never holds the
//! loop up). The agent's [`StoreSource`] reads every rank's key of the current generation when
//! scraped; a one-process run without an agent keeps its figures on a [`Board`] instead.
//! [`encode`] renders a [`Snapshot`] in the OpenMetrics text format (`prometheus-client`),
//! every name prefixed `flotilla_`.
use crate::error::{LaunchError, Result};
use comm::group::Rendezvous;
use comm::store::StoreClient;
use prometheus_client::encoding::text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use serde::{Deserialize, Deserializer, Serialize};
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// Longest a store request of the publisher or the endpoint may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The store key of `rank`'s figures in `generation`.
pub fn key(generation: u64, rank: usize) -> String {
    format!("launch/g{generation}/metrics/{rank}")
}

/// One step's figures as a rank measured them (times in seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepFigures {
    /// Steps completed, counting this one.
    pub step: u64,
    /// The step's training loss (NaN: diverged).
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// The last validation loss measured (`--eval-every`), if any.
    pub val_loss: Option<f64>,
    /// Tokens per second of the step, all ranks together.
    #[serde(deserialize_with = "nan_if_null")]
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation of the step, a fraction.
    #[serde(deserialize_with = "nan_if_null")]
    pub mfu: f64,
    /// Wall time of the step, batch wait excluded.
    pub step_s: f64,
    /// Exposed communication of the step.
    pub comm_s: f64,
    /// Wait for the step's batch.
    pub data_s: f64,
    /// Training paused for a checkpoint after this step, if one was taken.
    pub ckpt_pause_s: Option<f64>,
}

/// JSON has no NaN: `serde_json` writes one as `null`, read back here as NaN.
fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// A rank's figures: its last step and its totals since it started (one generation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RankFigures {
    /// The last step's figures.
    pub last: StepFigures,
    /// Steps this process trained.
    pub steps: u64,
    /// Sum of `step_s`.
    pub step_s_total: f64,
    /// Sum of `comm_s`.
    pub comm_s_total: f64,
    /// Sum of `data_s`.
    pub data_s_total: f64,
    /// Checkpoints taken.
    pub checkpoints: u64,
    /// Sum of the checkpoint pauses.
    pub ckpt_pause_s_total: f64,
    /// The last checkpoint pause (0 before the first).
    pub ckpt_pause_s_last: f64,
}

impl RankFigures {
    /// Counts step `s` in.
    pub fn add(&mut self, s: StepFigures) {
        // A validation loss stays until the next evaluation replaces it.
        let val_loss = s.val_loss.or(self.last.val_loss);
        self.last = StepFigures { val_loss, ..s };
        self.steps += 1;
        self.step_s_total += s.step_s;
        self.comm_s_total += s.comm_s;
        self.data_s_total += s.data_s;
        if let Some(p) = s.ckpt_pause_s {
            self.checkpoints += 1;
            self.ckpt_pause_s_total += p;
            self.ckpt_pause_s_last = p;
        }
    }

    /// Data stall as a percentage of step time plus stall (000 eq. 4.2 on the totals).
    pub fn stall_pct(&self) -> f64 {
        let whole = self.step_s_total + self.data_s_total;
        if whole > 0.0 {
            100.0 * self.data_s_total / whole
        } else {
            0.0
        }
    }
}

/// What the endpoint shows: the job's generation, size and restarts, and each rank's figures
/// (ranks that have not finished a step yet are absent).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// The generation running.
    pub generation: u64,
    /// Workers of that generation.
    pub world: usize,
    /// Restarts of the job so far.
    pub restarts: u64,
    /// `(rank, figures)`, by rank.
    pub ranks: Vec<(usize, RankFigures)>,
}

/// Where the endpoint's figures come from.
pub trait Source: Send + Sync {
    /// The figures now.
    fn snapshot(&self) -> Result<Snapshot>;
}

/// The figures of a one-process run, kept in memory (no store, no agent).
#[derive(Debug, Default, Clone)]
pub struct Board(Arc<Mutex<Snapshot>>);

impl Board {
    /// A board for a job of `world` ranks.
    pub fn new(world: usize) -> Board {
        Board(Arc::new(Mutex::new(Snapshot {
            world,
            ..Snapshot::default()
        })))
    }

    /// Counts `rank`'s step `s` in.
    pub fn add_step(&self, rank: usize, s: StepFigures) {
        let mut snap = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match snap.ranks.iter_mut().find(|(r, _)| *r == rank) {
            Some((_, f)) => f.add(s),
            None => {
                let mut f = RankFigures::default();
                f.add(s);
                snap.ranks.push((rank, f));
                snap.ranks.sort_by_key(|(r, _)| *r);
            }
        }
    }
}

impl Source for Board {
    fn snapshot(&self) -> Result<Snapshot> {
        Ok(self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone())
    }
}

/// The job as the agent sees it: generation, world and restarts, updated by the agent loop.
#[derive(Debug, Default, Clone)]
pub struct JobView(Arc<Mutex<(u64, usize, u64)>>);

impl JobView {
    /// Generation `generation` of `world` workers runs, after `restarts` restarts.
    pub fn set(&self, generation: u64, world: usize, restarts: u64) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = (generation, world, restarts);
    }

    fn get(&self) -> (u64, usize, u64) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The agent's source: every rank's key of the current generation, read from the store.
pub struct StoreSource {
    store: Mutex<StoreClient>,
    view: JobView,
}

impl StoreSource {
    /// Reads through its own connection to the store of `store` (cloned), with the job as
    /// `view` says.
    pub fn new(store: &StoreClient, view: JobView) -> Result<StoreSource> {
        let store = store.try_clone()?.with_timeout(REQUEST_TIMEOUT);
        Ok(StoreSource {
            store: Mutex::new(store),
            view,
        })
    }
}

impl Source for StoreSource {
    fn snapshot(&self) -> Result<Snapshot> {
        let (generation, world, restarts) = self.view.get();
        let store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        // The store fences requests of older generations: read as the running one.
        store.set_generation(generation);
        let mut ranks = Vec::new();
        for rank in 0..world {
            if let Some(bytes) = store.get(&key(generation, rank))? {
                // A key written by something else is skipped, not shown wrong.
                if let Ok(f) = serde_json::from_slice::<RankFigures>(&bytes) {
                    ranks.push((rank, f));
                }
            }
        }
        Ok(Snapshot {
            generation,
            world,
            restarts,
            ranks,
        })
    }
}

/// A worker's publisher: a thread putting this rank's latest figures in the store.
pub struct Publisher {
    figures: RankFigures,
    tx: Option<Sender<RankFigures>>,
    thread: Option<JoinHandle<()>>,
}

impl Publisher {
    /// Connects to the store of `rdv` (stamped with its generation) for `rank`.
    pub fn start(rdv: &Rendezvous, rank: usize) -> Result<Publisher> {
        let store = rdv
            .connect(Duration::from_secs(60))?
            .with_timeout(REQUEST_TIMEOUT);
        let key = key(rdv.generation, rank);
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("metrics-{rank}"))
            .spawn(move || publish_loop(&store, &key, &rx))
            .map_err(|e| LaunchError::io("starting the metrics publisher thread", e))?;
        Ok(Publisher {
            figures: RankFigures::default(),
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Counts step `s` in and publishes the figures (in the background).
    pub fn add_step(&mut self, s: StepFigures) {
        self.figures.add(s);
        if let Some(tx) = &self.tx {
            // The thread ends only when the sender is dropped: a send cannot fail before.
            let _ = tx.send(self.figures);
        }
    }
}

impl Drop for Publisher {
    /// Publishes what is pending, then stops the thread.
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Publishes the newest figures received until the channel closes; a failed write is said
/// once per outage (the next step's figures try again).
fn publish_loop(store: &StoreClient, key: &str, rx: &Receiver<RankFigures>) {
    let mut failed = false;
    while let Ok(mut f) = rx.recv() {
        while let Ok(newer) = rx.try_recv() {
            f = newer;
        }
        let Ok(json) = serde_json::to_vec(&f) else {
            continue;
        };
        match store.set(key, &json) {
            Ok(()) => failed = false,
            Err(e) if !failed => {
                failed = true;
                tracing::warn!("publishing metrics to the store: {e}");
            }
            Err(_) => {}
        }
    }
}

/// `snap` in the OpenMetrics text format (what Prometheus scrapes), names prefixed
/// `flotilla_`. Job-wide figures are the lowest rank's (rank 0's once it has stepped); each
/// rank's step and step time carry a `rank` label.
pub fn encode(snap: &Snapshot) -> Result<String> {
    let mut reg = Registry::with_prefix("flotilla");
    let gauge = |reg: &mut Registry, name: &str, help: &str, unit: Option<Unit>, v: f64| {
        let g = Gauge::<f64, AtomicU64>::default();
        g.set(v);
        match unit {
            Some(u) => reg.register_with_unit(name, help, u, g),
            None => reg.register(name, help, g),
        }
    };
    let counter = |reg: &mut Registry, name: &str, help: &str, unit: Option<Unit>, v: f64| {
        let c = Counter::<f64, AtomicU64>::default();
        c.inc_by(v);
        match unit {
            Some(u) => reg.register_with_unit(name, help, u, c),
            None => reg.register(name, help, c),
        }
    };
    gauge(
        &mut reg,
        "generation",
        "Restart generation running",
        None,
        snap.generation as f64,
    );
    gauge(
        &mut reg,
        "world_size",
        "Workers in the generation",
        None,
        snap.world as f64,
    );
    counter(
        &mut reg,
        "restarts",
        "Restarts of the job",
        None,
        snap.restarts as f64,
    );
    if let Some((_, f)) = snap.ranks.first() {
        let s = &f.last;
        let secs = Some(Unit::Seconds);
        gauge(
            &mut reg,
            "step",
            "Steps completed (lead rank)",
            None,
            s.step as f64,
        );
        gauge(
            &mut reg,
            "loss",
            "Training loss of the last step (nats/token)",
            None,
            s.loss,
        );
        if let Some(v) = s.val_loss {
            gauge(
                &mut reg,
                "validation_loss",
                "Last validation loss (nats/token)",
                None,
                v,
            );
        }
        gauge(
            &mut reg,
            "tokens_per_second",
            "Tokens per second of the last step, all ranks",
            None,
            s.tokens_per_s,
        );
        gauge(
            &mut reg,
            "mfu",
            "Model FLOPs utilisation of the last step",
            Some(Unit::Other("ratio".into())),
            s.mfu,
        );
        gauge(
            &mut reg,
            "step_exposed_comm",
            "Exposed communication of the last step",
            secs.clone(),
            s.comm_s,
        );
        counter(
            &mut reg,
            "exposed_comm",
            "Exposed communication, this generation",
            secs.clone(),
            f.comm_s_total,
        );
        gauge(
            &mut reg,
            "step_data_wait",
            "Wait for the last step's batch",
            secs.clone(),
            s.data_s,
        );
        gauge(
            &mut reg,
            "data_stall_percent",
            "Batch wait over step time plus wait, this generation (%)",
            None,
            f.stall_pct(),
        );
        gauge(
            &mut reg,
            "last_checkpoint_pause",
            "Training pause of the last checkpoint",
            secs.clone(),
            f.ckpt_pause_s_last,
        );
        counter(
            &mut reg,
            "checkpoint_pause",
            "Training paused for checkpoints, this generation",
            secs,
            f.ckpt_pause_s_total,
        );
        counter(
            &mut reg,
            "checkpoints",
            "Checkpoints taken, this generation",
            None,
            f.checkpoints as f64,
        );
    }
    let step_s = Family::<Vec<(String, String)>, Gauge<f64, AtomicU64>>::default();
    let step = Family::<Vec<(String, String)>, Gauge<f64, AtomicU64>>::default();
    for (rank, f) in &snap.ranks {
        let labels = vec![("rank".to_string(), rank.to_string())];
        step_s.get_or_create(&labels).set(f.last.step_s);
        step.get_or_create(&labels).set(f.last.step as f64);
    }
    reg.register_with_unit(
        "rank_step_time",
        "Each rank's last step time",
        Unit::Seconds,
        step_s,
    );
    reg.register("rank_step", "Each rank's steps completed", step);
    let mut out = String::new();
    text::encode(&mut out, &reg).map_err(|_| {
        LaunchError::io(
            "encoding the metrics",
            std::io::Error::other("the OpenMetrics encoder failed"),
        )
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(n: u64, pause: Option<f64>) -> StepFigures {
        StepFigures {
            step: n,
            loss: 5.0 - n as f64 * 0.1,
            val_loss: (n == 2).then_some(4.5),
            tokens_per_s: 1000.0,
            mfu: 0.25,
            step_s: 0.3,
            comm_s: 0.1,
            data_s: 0.1,
            ckpt_pause_s: pause,
        }
    }

    #[test]
    fn figures_round_trip_and_total() {
        let mut f = RankFigures::default();
        f.add(step(1, None));
        f.add(step(2, Some(0.05)));
        f.add(StepFigures {
            loss: f64::NAN,
            ..step(3, None)
        });
        assert_eq!((f.steps, f.checkpoints, f.last.step), (3, 1, 3));
        assert_eq!(f.last.val_loss, Some(4.5), "kept until replaced");
        assert!((f.stall_pct() - 25.0).abs() < 1e-9);
        let back: RankFigures = serde_json::from_slice(&serde_json::to_vec(&f).unwrap()).unwrap();
        assert!(back.last.loss.is_nan());
        assert_eq!(back.ckpt_pause_s_total, 0.05);
    }

    #[test]
    fn the_exposition_names_every_figure() {
        let board = Board::new(2);
        let empty = encode(&board.snapshot().unwrap()).unwrap();
        assert!(empty.contains("flotilla_world_size 2"), "{empty}");
        assert!(!empty.contains("flotilla_loss"), "{empty}");
        board.add_step(1, step(1, None));
        board.add_step(0, step(1, None));
        board.add_step(0, step(2, Some(0.05)));
        let mut snap = board.snapshot().unwrap();
        snap.restarts = 1;
        let text = encode(&snap).unwrap();
        for line in [
            "# TYPE flotilla_restarts counter",
            "flotilla_restarts_total 1.0",
            "flotilla_step 2.0",
            "flotilla_step_exposed_comm_seconds 0.1",
            "flotilla_exposed_comm_seconds_total 0.2",
            "flotilla_data_stall_percent 25.0",
            "flotilla_last_checkpoint_pause_seconds 0.05",
            "flotilla_validation_loss 4.5",
            "# TYPE flotilla_mfu_ratio gauge",
            "flotilla_mfu_ratio 0.25",
            "flotilla_checkpoint_pause_seconds_total 0.05",
            "flotilla_checkpoints_total 1.0",
            "flotilla_rank_step_time_seconds{rank=\"1\"} 0.3",
            "flotilla_rank_step{rank=\"0\"} 2.0",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        // Every family is named once (OpenMetrics).
        let mut families: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let n = families.len();
        families.sort();
        families.dedup_by_key(|l| l.split(' ').nth(2));
        assert_eq!(families.len(), n, "{text}");
    }
}
