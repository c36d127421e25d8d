//! The process group: identity, links, op ordering, failure handling and algorithm selection.

use super::config::{Choice, GroupConfig};
use super::connect::{WireSpec, wire};
use super::gate::{Gate, TurnError};
use crate::algo::{Algo, Ctx};
use crate::dtype::DType;
use crate::engine::OpCtx;
use crate::error::{CommError, OpDesc, Result};
use crate::flight::FlightRecorder;
use crate::frame::OpKind;
use crate::model::{Selection, Topology, choose, select};
use crate::store::{Secret, StoreClient};
use crate::transport::shm::ShmDomain;
use crate::transport::{Link, LinkKind};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How to reach the job's rendezvous store, and the job's identity there.
#[derive(Clone)]
pub struct Rendezvous {
    /// Address of the store.
    pub addr: SocketAddr,
    /// The job secret.
    pub secret: Secret,
    /// Membership generation (bumped by the launcher on every restart).
    pub generation: u64,
}

impl Rendezvous {
    /// Opens an authenticated store connection stamped with this generation.
    pub fn connect(&self, timeout: Duration) -> Result<StoreClient> {
        StoreClient::connect(self.addr, &self.secret, self.generation, timeout)
    }
}

/// Per-call options.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpOptions {
    /// Force this algorithm (overrides config and env).
    pub algo: Option<Algo>,
    /// Timeout of this call (default: the group's).
    pub timeout: Option<Duration>,
}

/// How long a failing rank waits for the other ranks' failure reports before it names the
/// silent ones (capped by the op timeout). Live ranks fail within milliseconds of each other
/// once links close, so one second is ample and keeps the error within timeout + 2 s.
pub const DIAGNOSIS_GRACE: Duration = Duration::from_secs(1);

/// An op's place in the order: local ticket and wire sequence number.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Turn {
    pub ticket: u64,
    pub seq: u64,
}

/// Reusable buffers owned by the group, so ops do not allocate (and fault in) fresh memory.
#[derive(Default)]
pub struct Scratch {
    /// Staging copy of a caller's buffer (reduce-scatter input, reduce).
    pub stage: Vec<u8>,
    /// Temporary space for algorithms.
    pub algo: Vec<u8>,
}

impl Scratch {
    /// A staging copy of `src` (the buffer grows, never shrinks), and the algorithm scratch
    /// beside it.
    pub fn stage_copy(&mut self, src: &[u8]) -> (&mut [u8], &mut Vec<u8>) {
        if self.stage.len() < src.len() {
            self.stage.resize(src.len(), 0);
        }
        let stage = &mut self.stage[..src.len()];
        stage.copy_from_slice(src);
        (stage, &mut self.algo)
    }
}

/// Mutable state used while an op runs.
pub(crate) struct Core {
    pub links: Vec<Option<Box<dyn Link>>>,
    /// Reusable temporary buffers.
    pub scratch: Scratch,
    _shm: Option<ShmDomain>,
}

/// A unit of background work (an async op).
pub(crate) type Job = Box<dyn FnOnce() + Send>;

pub(crate) struct Inner {
    pub name: String,
    pub id: u64,
    pub generation: u64,
    pub rank: usize,
    pub size: usize,
    pub prefix: String,
    pub rdv: Rendezvous,
    pub store: StoreClient,
    /// A second connection with a short timeout, for failure handling.
    pub abort_store: StoreClient,
    pub cfg: GroupConfig,
    pub kinds: Vec<Option<LinkKind>>,
    pub host_of: Vec<usize>,
    pub host_names: Vec<String>,
    /// Process id of every rank.
    pub pids: Vec<i32>,
    pub topo: Topology,
    /// The group's layout with default link parameters: what [`Choice::Layout`] chooses from.
    pub layout_topo: Topology,
    /// Nanoseconds an op spins before it sleeps: the configured spin, or until calibration
    /// measures the group round, [`super::config::DEFAULT_SPIN`] (see `GroupConfig::spin`).
    pub spin_ns: AtomicU64,
    pub core: Mutex<Core>,
    pub gate: Gate,
    /// Next collective sequence number (identical on every rank).
    pub coll_seq: AtomicU64,
    /// Next point-to-point sequence number per peer and direction.
    pub p2p_send: Mutex<Vec<u64>>,
    pub p2p_recv: Mutex<Vec<u64>>,
    pub flight: FlightRecorder,
    /// The most recent op's kind, bytes and forced algorithm (its [`Selection`] is rebuilt on
    /// demand, so an op only prices what its choice needs).
    pub last: Mutex<Option<(OpKind, usize, Option<Algo>)>>,
    pub worker: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
}

impl Inner {
    /// The algorithm forced on a `kind` op of `bytes`: the call's, else the config's, else under
    /// [`Choice::Layout`] the layout's choice; None leaves it to the calibrated model.
    pub fn forced(&self, kind: OpKind, bytes: usize, call: Option<Algo>) -> Option<Algo> {
        call.or_else(|| self.cfg.algo.get(&kind).copied())
            .or_else(|| {
                // Ops with no algorithms to choose from (point-to-point) are left alone.
                (self.cfg.choose == Choice::Layout)
                    .then(|| choose(kind, bytes, &self.layout_topo, None))
                    .filter(|a| a.serves(kind))
            })
    }

    /// How long an op spins before it sleeps (see [`Inner::spin_ns`]).
    pub fn spin(&self) -> Duration {
        Duration::from_nanos(self.spin_ns.load(Ordering::Relaxed))
    }

    /// Sets the spin of every later op.
    pub fn set_spin(&self, spin: Duration) {
        self.spin_ns
            .store(spin.as_nanos() as u64, Ordering::Relaxed);
    }
}

/// A set of ranks that run collectives together. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct ProcessGroup {
    pub(crate) inner: Arc<Inner>,
}

/// 64-bit FNV-1a of a group name: the group id on the wire.
pub fn group_id(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl ProcessGroup {
    /// Creates (collectively) the group `name` of `size` ranks, this one being `rank`: every
    /// member calls this with the same name and size. Publishes this rank's addresses through the
    /// store, connects to every peer, and measures α and β per transport.
    pub fn new(
        rdv: &Rendezvous,
        name: &str,
        rank: usize,
        size: usize,
        cfg: GroupConfig,
    ) -> Result<ProcessGroup> {
        if size == 0 || rank >= size {
            return Err(CommError::InvalidArgument(format!(
                "rank {rank} is not in a group of size {size}"
            )));
        }
        if name.is_empty() || name.contains('/') {
            return Err(CommError::InvalidArgument(format!(
                "group name '{name}' must be non-empty and contain no '/'"
            )));
        }
        let store = rdv.connect(cfg.connect_timeout)?;
        let id = group_id(name);
        let prefix = format!("pg/{name}/g{}", rdv.generation);
        let w = match wire(&WireSpec {
            store: &store,
            store_addr: rdv.addr,
            secret: &rdv.secret,
            prefix: &prefix,
            group_id: id,
            generation: rdv.generation,
            rank,
            size,
            cfg: &cfg,
        }) {
            Ok(w) => w,
            Err(e) => {
                // Tell the other ranks at once instead of leaving them to their deadline.
                let _ = store.set(
                    &super::connect::wiring_abort_key(&prefix),
                    format!("rank {rank}: {e}").as_bytes(),
                );
                return Err(e);
            }
        };
        let topo = super::calibrate::topology(&w.host_of, size, w.direct_read, &cfg);
        let inner = Inner {
            name: name.to_string(),
            id,
            generation: rdv.generation,
            rank,
            size,
            prefix,
            rdv: rdv.clone(),
            abort_store: store.try_clone()?.with_timeout(Duration::from_secs(2)),
            store,
            kinds: w.kinds,
            host_of: w.host_of,
            host_names: w.host_names,
            pids: w.pids,
            layout_topo: topo.clone(),
            topo,
            spin_ns: AtomicU64::new(cfg.spin_now().as_nanos() as u64),
            core: Mutex::new(Core {
                links: w.links,
                scratch: Scratch::default(),
                _shm: w._shm,
            }),
            gate: Gate::new(),
            coll_seq: AtomicU64::new(0),
            p2p_send: Mutex::new(vec![0; size]),
            p2p_recv: Mutex::new(vec![0; size]),
            flight: FlightRecorder::new(cfg.flight_capacity),
            last: Mutex::new(None),
            worker: Mutex::new(None),
            cfg,
        };
        let mut g = ProcessGroup {
            inner: Arc::new(inner),
        };
        if g.inner.cfg.calibrate && size > 1 {
            let topo = super::calibrate::calibrate(&g)?;
            let inner = Arc::get_mut(&mut g.inner).expect("not shared yet");
            // Rank 0's host facts (what every rank selects from), none of its timings.
            inner.layout_topo.cores = topo.cores;
            if topo.direct_read.is_none() {
                inner.layout_topo.direct_read = None;
            }
            inner.topo = topo;
        }
        tracing::debug!(group = name, rank, size, topology = ?g.inner.topo, "group ready");
        Ok(g)
    }

    /// How long an op spins (yielding the CPU) before it sleeps: the configured
    /// `GroupConfig::spin`, or the automatic one from the measured group round.
    pub fn spin(&self) -> Duration {
        self.inner.spin()
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The transport to `peer` (None for this rank).
    pub fn link_kind(&self, peer: usize) -> Option<LinkKind> {
        self.inner.kinds.get(peer).copied().flatten()
    }

    /// Host index of every rank (ranks with equal index share a host).
    pub fn host_of(&self) -> &[usize] {
        &self.inner.host_of
    }

    /// Identity string of every host, by host index (see [`host_of`](Self::host_of)).
    pub fn host_names(&self) -> &[String] {
        &self.inner.host_names
    }

    /// What the selector knows: sizes, hosts, calibrated α/β per transport and γ.
    pub fn topology(&self) -> &Topology {
        &self.inner.topo
    }

    /// The algorithm the group would pick for `op` over `bytes`, with every candidate's
    /// predicted time (the same choice every rank makes).
    pub fn explain(&self, op: OpKind, bytes: usize) -> Selection {
        select(
            op,
            bytes,
            &self.inner.topo,
            self.inner.forced(op, bytes, None),
        )
    }

    /// The selection made for the most recent op.
    pub fn last_selection(&self) -> Option<Selection> {
        let last = *self.inner.last.lock().unwrap_or_else(|p| p.into_inner());
        last.map(|(op, bytes, forced)| select(op, bytes, &self.inner.topo, forced))
    }

    /// The flight recorder's table of recent ops.
    pub fn flight_dump(&self) -> String {
        self.inner.flight.dump()
    }

    /// The recorder itself.
    pub fn flight(&self) -> &FlightRecorder {
        &self.inner.flight
    }

    /// Why the group is unusable, if an op failed.
    pub fn aborted(&self) -> Option<String> {
        self.inner.gate.poisoned()
    }

    /// Creates (collectively, over this group) a sub-group of `ranks` (ranks of this group, in
    /// the order they get in the sub-group). Every member of this group must call it with the
    /// same arguments; members of `ranks` get `Some`, the others `None`.
    pub fn subgroup(&self, name: &str, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            if r >= self.size() || std::mem::replace(&mut seen[r], true) {
                return Err(CommError::InvalidArgument(format!(
                    "sub-group '{name}': rank list {ranks:?} has a rank outside 0..{} or a duplicate",
                    self.size()
                )));
            }
        }
        // Agree that everyone asked for the same thing before anyone starts connecting.
        let spec = format!("{name}:{ranks:?}");
        let mut all = vec![0u8; self.size() * 8];
        let mine = group_id(&spec).to_le_bytes();
        self.all_gather(&mine, &mut all)?;
        if all.chunks(8).any(|c| c != mine) {
            return Err(CommError::InvalidArgument(format!(
                "sub-group '{name}': members of '{}' passed different rank lists",
                self.name()
            )));
        }
        match ranks.iter().position(|&r| r == self.rank()) {
            Some(me) => {
                let full = format!("{}.{name}", self.name());
                ProcessGroup::new(
                    &self.inner.rdv,
                    &full,
                    me,
                    ranks.len(),
                    self.inner.cfg.clone(),
                )
                .map(Some)
            }
            None => Ok(None),
        }
    }

    /// Takes this rank's place in the op order: a local ticket and the next collective sequence
    /// number (identical on every rank, since every rank calls collectives in the same order).
    pub(crate) fn collective_turn(&self) -> Turn {
        Turn {
            ticket: self.inner.gate.take(),
            seq: self.inner.coll_seq.fetch_add(1, Ordering::SeqCst),
        }
    }

    /// Runs one op at its turn: selects the algorithm, runs `body`, records it in the flight
    /// recorder, and turns a failure into a poisoned group with the root cause attached.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_op(
        &self,
        turn: Turn,
        kind: OpKind,
        dtype: DType,
        signature: u64,
        bytes: usize,
        opts: &OpOptions,
        body: impl FnOnce(&mut Ctx<'_>, Algo, &mut Scratch) -> Result<()>,
    ) -> Result<()> {
        let Turn { ticket, seq } = turn;
        let inner = &self.inner;
        let timeout = opts.timeout.unwrap_or(inner.cfg.timeout);
        let forced = inner.forced(kind, bytes, opts.algo);
        let algo = choose(kind, bytes, &inner.topo, forced);
        let desc = OpDesc {
            group: inner.name.clone(),
            kind: kind.name(),
            seq,
            bytes,
            algo: algo.name(),
        };
        let fid = inner
            .flight
            .record(seq, kind.name(), dtype.name(), bytes, false);
        if let Some(a) = forced.filter(|a| !a.serves(kind)) {
            inner.flight.finish(fid, 0, Err("invalid algorithm".into()));
            self.skip_turn(ticket, timeout);
            return Err(CommError::InvalidArgument(format!(
                "algorithm {} does not implement {}",
                a.name(),
                kind.name()
            )));
        }
        match inner.gate.wait_turn(ticket, timeout) {
            Ok(()) => {}
            Err(TurnError::Poisoned(reason)) => {
                inner.flight.finish(fid, 0, Err("group aborted".into()));
                return Err(CommError::Aborted {
                    group: inner.name.clone(),
                    reason,
                });
            }
            Err(TurnError::Timeout { waiting_for }) => {
                let e = CommError::Timeout {
                    op: Box::new(desc),
                    timeout,
                    missing: vec![],
                    cause: Some(format!(
                        "this rank's earlier op (ticket {waiting_for}) is still running"
                    )),
                };
                inner.flight.finish(fid, 0, Err(e.to_string()));
                self.fail(&e);
                return Err(e);
            }
        }
        tracing::debug!(target: "flotilla::select", group = %inner.name, seq, "{}",
            select(kind, bytes, &inner.topo, forced));
        *inner.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((kind, bytes, forced));
        inner.flight.start(fid, algo.name());
        let mut core = inner.core.lock().unwrap_or_else(|p| p.into_inner());
        let Core { links, scratch, .. } = &mut *core;
        let op = OpCtx::new(
            desc,
            kind,
            dtype,
            signature,
            inner.id,
            inner.generation,
            inner.rank,
            inner.size,
            timeout,
        );
        let mut ctx = Ctx {
            links: links.as_mut_slice(),
            op,
        };
        ctx.op.spin = inner.spin();
        let began = crate::trace::enabled().then(Instant::now);
        let result = body(&mut ctx, algo, scratch);
        if let Some(b) = began {
            crate::trace::record(kind.name(), &inner.name, bytes, algo.name(), b);
        }
        let sent = ctx.op.bytes_sent;
        drop(core);
        match result {
            Ok(()) => {
                inner.flight.finish(fid, sent, Ok(()));
                inner.gate.done();
                Ok(())
            }
            Err(e) => {
                let e = self.diagnose(e);
                inner.flight.finish(fid, sent, Err(e.to_string()));
                self.fail(&e);
                inner.gate.done();
                Err(e)
            }
        }
    }

    fn skip_turn(&self, ticket: u64, timeout: Duration) {
        if self.inner.gate.wait_turn(ticket, timeout).is_ok() {
            self.inner.gate.done();
        }
    }

    /// Works out who is really to blame for a failed op.
    ///
    /// The rank's own view is local ("waiting for rank 0"), but rank 0 may itself be waiting for
    /// a dead or stopped rank. So every failing rank (1) publishes its error under
    /// `{prefix}/fail/{rank}` and offers it as the group's root cause (first writer wins),
    /// (2) closes its links so that ranks waiting on it fail at once instead of at their
    /// deadline, then (3) waits up to [`DIAGNOSIS_GRACE`] for the other ranks' reports. Live ranks
    /// all fail within that window; the ranks that never report are dead or stopped, and the
    /// error names them.
    fn diagnose(&self, mut e: CommError) -> CommError {
        let inner = &self.inner;
        let st = &inner.abort_store;
        let key = |r: usize| format!("{}/fail/{r}", inner.prefix);
        let ours = format!("rank {}: {e}", inner.rank);
        let _ = st.set(&key(inner.rank), ours.as_bytes());
        let first = st
            .compare_set(&format!("{}/abort", inner.prefix), None, ours.as_bytes())
            .ok()
            .flatten()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .filter(|c| *c != ours);
        self.shutdown_links();
        let keys: Vec<String> = (0..inner.size).map(key).collect();
        let grace = inner.cfg.diagnosis_grace.min(inner.cfg.timeout);
        let silent: Vec<usize> = match st.wait(&keys, grace) {
            Ok(_) => Vec::new(),
            Err(_) => (0..inner.size)
                .filter(|&r| !matches!(st.get(&key(r)), Ok(Some(_))))
                .collect(),
        };
        let mut cause: Vec<String> = Vec::new();
        if !silent.is_empty() {
            let who = silent
                .iter()
                .map(|r| format!("rank {r}"))
                .collect::<Vec<_>>()
                .join(", ");
            cause.push(format!(
                "{who} sent no failure report: dead, stopped or unreachable"
            ));
        }
        cause.extend(first);
        let cause = (!cause.is_empty()).then(|| cause.join("; first failure: "));
        match &mut e {
            CommError::Timeout {
                cause: c, missing, ..
            } => {
                if !silent.is_empty() {
                    *missing = silent;
                }
                *c = cause;
            }
            CommError::PeerLost { cause: c, .. } => *c = cause,
            _ => {}
        }
        e
    }

    fn shutdown_links(&self) {
        if let Ok(mut core) = self.inner.core.try_lock() {
            for l in core.links.iter_mut().flatten() {
                l.shutdown();
            }
        }
    }

    /// Poisons the group, closes every link so peers notice at once, and prints the flight log.
    pub(crate) fn fail(&self, e: &CommError) {
        let inner = &self.inner;
        inner.gate.poison(e.to_string());
        self.shutdown_links();
        let dump = inner.flight.dump();
        if inner.cfg.quiet_failures {
            tracing::debug!(group = %inner.name, rank = inner.rank, "collective failed (handled by the caller): {e}\nflight recorder (rank {}):\n{dump}", inner.rank);
        } else {
            tracing::error!(group = %inner.name, rank = inner.rank, "collective failed: {e}\nflight recorder (rank {}):\n{dump}", inner.rank);
        }
    }

    /// Runs `job` on the group's background worker (started on first use), in submission order.
    pub(crate) fn spawn_job(&self, job: Job) -> Result<()> {
        let mut w = self.inner.worker.lock().unwrap_or_else(|p| p.into_inner());
        if w.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(format!("flotilla-{}-{}", self.inner.name, self.inner.rank))
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                })
                .map_err(|e| CommError::io("spawn group worker", e))?;
            *w = Some(tx);
        }
        w.as_ref()
            .expect("worker started above")
            .send(job)
            .map_err(|_| CommError::Aborted {
                group: self.inner.name.clone(),
                reason: "worker thread is gone".into(),
            })
    }
}
