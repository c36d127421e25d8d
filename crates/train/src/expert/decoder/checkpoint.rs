//! Checkpoints of the MoE decoder trained with expert parallelism ([`MoeTrainer`]), in the
//! format of [`crate::checkpoint`] (a step directory of per-rank safetensors files, the
//! manifest committed last by rank 0; parameters under `model.`, AdamW's moments under
//! `optim.exp_avg.` and `optim.exp_avg_sq.`), with the MoE model's own tensors:
//!
//! - Tensors, in the ep = 1 model's global shapes: `wte (V, C)`, `wpe (T, C)`, per block `i`
//!   `h.i.{ln1,qkv,proj,ln2}.{w,b}`, then `lnf.{w,b}`, `head (V, C)`, and per block the router
//!   `h.i.router (E, C)` and every expert `e`'s `h.i.expert.e.{fc.w (F, C), fc.b (F),
//!   fcp.w (C, F), fcp.b (C)}`.
//! - Who writes what ([`MoeTrainer::save_checkpoint`], a collective over the EP group):
//!   every rank writes only pieces it owns. An expert's tensors are written whole by the one
//!   rank holding it; the replicated tensors (dense part and routers, bit-identical on every
//!   rank) are split by rows, rank r of ep writing [`ckpt::rank_rows`]`(r, ep)` of each, as
//!   `ep` data-parallel ranks do. No gather: each rank writes `1/ep` of the dense state and its
//!   own experts.
//! - State: `step`, `optimizer_step`, `batches_drawn`, `rows_drawn` (the group's global row
//!   cursor), `loader`, `seed`, `world` (ep) and the MoE model config; the config hash covers
//!   the training config with the *global* batch (`batch · ep`) instead of the per-rank one,
//!   the schedule and the decay policy, not the EP degree or the thread count.
//! - Load ([`MoeTrainer::restore`]): each rank reads the tensors it holds (the replicated ones
//!   whole, assembled by the reader from every writer's rows; its experts), so a checkpoint
//!   resumes under any EP degree dividing E with the same global batch (EP 2 with 2 rows per
//!   rank continues EP 1 with 4 rows, and back), the data stream continuing at the global row
//!   cursor. Another model (a missing tensor or another shape) or another config hash is
//!   refused naming what differs.
use std::ops::Range;
use std::path::Path;

use ckpt::{Checkpoint, CheckpointMeta, DType, RankWriter, Slice, TensorMeta, f32_bytes};
use comm::ReduceOp;
use serde_json::json;

use super::{MoeModelLayout, MoeTrainer};
use crate::checkpoint::{
    Checkpointer, EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, MODEL_PREFIX, SaveSummary, check_tensor_metas,
    newest_committed, piece_refs, row_piece, save_collectively, saved_run_hashed,
};
use crate::error::{Result, TrainError};
use crate::zero::state::StatePiece;

/// One tensor of the model: its name and global shape, where it lies in this rank's buffer
/// (None: an expert another rank holds), and whether every rank holds it (written by rows).
struct Entry {
    name: String,
    shape: Vec<u64>,
    local: Option<Range<usize>>,
    replicated: bool,
}

/// The model's tensors as rank `l.moe.rank` of `l.moe.ep` holds them (module doc order).
fn entries(l: &MoeModelLayout) -> Vec<Entry> {
    let (c, v, t) = (l.cfg.moe.channels, l.cfg.vocab, l.cfg.seq_len);
    let mut out = Vec::new();
    let mut push = |name: String, shape: &[usize], local: Option<Range<usize>>, rep: bool| {
        out.push(Entry {
            name,
            shape: shape.iter().map(|&d| d as u64).collect(),
            local,
            replicated: rep,
        })
    };
    push("wte".into(), &[v, c], Some(l.wte.clone()), true);
    push("wpe".into(), &[t, c], Some(l.wpe.clone()), true);
    let lins = |i: usize| {
        let b = &l.blocks[i];
        [
            ("ln1", b.ln1),
            ("qkv", b.qkv),
            ("proj", b.proj),
            ("ln2", b.ln2),
        ]
    };
    for i in 0..l.blocks.len() {
        for (n, lin) in lins(i) {
            let w: &[usize] = if lin.c == 1 {
                &[lin.oc]
            } else {
                &[lin.oc, lin.c]
            };
            push(format!("h.{i}.{n}.w"), w, Some(lin.w()), true);
            push(format!("h.{i}.{n}.b"), &[lin.oc], Some(lin.b()), true);
        }
    }
    push("lnf.w".into(), &[c], Some(l.lnf.w()), true);
    push("lnf.b".into(), &[c], Some(l.lnf.b()), true);
    push("head".into(), &[v, c], Some(l.head.clone()), true);
    let (e_all, f) = (l.cfg.moe.experts, l.cfg.moe.hidden);
    let (el, mine) = (l.moe.local_experts(), l.moe.expert_range());
    let ex = l.moe.expert_params();
    for (i, b) in l.blocks.iter().enumerate() {
        push(
            format!("h.{i}.router"),
            &[e_all, c],
            Some(l.router(b)),
            true,
        );
        for e in 0..e_all {
            let at = mine.contains(&e).then(|| l.expert(b, e % el).start);
            for (n, r, shape) in [
                ("fc.w", &ex.fc_w, &[f, c][..]),
                ("fc.b", &ex.fc_b, &[f]),
                ("fcp.w", &ex.fcp_w, &[c, f]),
                ("fcp.b", &ex.fcp_b, &[c]),
            ] {
                let local = at.map(|a| a + r.start..a + r.end);
                push(format!("h.{i}.expert.{e}.{n}"), shape, local, false);
            }
        }
    }
    out
}

/// The checkpoint's tensors: every entry under [`MODEL_PREFIX`], then under each moment's.
fn metas(entries: &[Entry]) -> Vec<TensorMeta> {
    [MODEL_PREFIX, EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX]
        .into_iter()
        .flat_map(|p| {
            entries.iter().map(move |e| TensorMeta {
                name: format!("{p}{}", e.name),
                dtype: DType::F32,
                shape: e.shape.clone(),
            })
        })
        .collect()
}

impl MoeTrainer {
    /// The hash of everything that decides the numbers but the EP degree, the thread count
    /// and the number of steps: the config with the global batch, the schedule, the decay.
    pub fn config_hash(&self) -> String {
        let mut c = self.config().clone();
        c.batch *= self.group().size();
        c.threads = 0;
        // The loader's batch is derived from the rank's rows: the global one, as above.
        if let crate::config::DataSpec::Dataset { loader, .. } = &mut c.data {
            loader.global_batch = c.batch as u64;
        }
        let (schedule, decay_all) = self.schedule();
        ckpt::checksum_hex(format!("moe {c:?} {schedule:?} decay_all {decay_all}").as_bytes())
    }

    /// Saves the current step under `dir` (created if missing): a collective every rank of
    /// the EP group must call; each writes only the pieces it owns (module doc), rank 0
    /// commits. A failed write on any rank is an error on all and nothing is committed.
    /// Returns the step saved.
    pub fn save_checkpoint(&mut self, dir: &Path, run_id: &str) -> Result<u64> {
        let step = self.steps_done();
        let (rank, ep) = self.writer();
        let meta = self.checkpoint_meta(run_id);
        let write = |meta: &CheckpointMeta| {
            let pieces = self.owned_pieces(&meta.tensors);
            let refs = piece_refs(&meta.tensors, &pieces);
            Ok(RankWriter::write_all(dir, step, rank, &refs)?)
        };
        save_collectively(dir, step, (rank, ep), meta, write, |ok, what| {
            self.agree(step, ok, what)
        })
    }

    /// Saves the current step through `ck` (asynchronously when it saves so: this rank's pieces
    /// copied into the host buffer and written in the background), `ck` saving as
    /// [`MoeTrainer::writer`].
    pub fn save_into(&mut self, ck: &mut Checkpointer, run_id: &str) -> Result<SaveSummary> {
        let step = self.steps_done();
        let meta = self.checkpoint_meta(run_id);
        let pieces = self.owned_pieces(&meta.tensors);
        let refs = piece_refs(&meta.tensors, &pieces);
        ck.save_pieces(step, meta.clone(), &refs)
    }

    /// This rank's index and the writers: the EP group's rank and size.
    pub fn writer(&self) -> (u32, u32) {
        (self.group().rank() as u32, self.group().size() as u32)
    }

    /// Everything of a checkpoint of the current step but the tensors' bytes.
    fn checkpoint_meta(&mut self, run_id: &str) -> CheckpointMeta {
        let (_, ep) = self.writer();
        let loader = self.loader_state().map(|s| s.to_json());
        let state = json!({
            "step": self.steps_done(),
            "optimizer_step": self.optimizer().step_count(),
            "batches_drawn": self.batches_drawn(),
            "rows_drawn": self.rows_drawn(),
            "loader": loader,
            "seed": self.config().seed,
            "world": ep,
            "batch": self.config().batch,
            "moe_model_config": format!("{:?}", self.config().model),
        });
        CheckpointMeta {
            run_id: run_id.to_string(),
            world_size: ep,
            layout: json!({"ep": ep, "experts": self.config().model.moe.experts,
                "split": "dim0 (dense, routers); experts whole by owner"}),
            config_hash: self.config_hash(),
            tensors: metas(&entries(self.layout())),
            state,
        }
    }

    /// The pieces this rank owns (module doc) of the tensors `tensors`: its experts whole, its
    /// rows of the replicated tensors, for the parameters and both moments.
    fn owned_pieces<'a>(&'a self, tensors: &[TensorMeta]) -> Vec<StatePiece<'a>> {
        let (rank, ep) = self.writer();
        let entries = entries(self.layout());
        let (m, v) = self.optimizer().moments();
        let bufs = [self.params(), m, v];
        let mut pieces: Vec<StatePiece> = Vec::new();
        for (k, buf) in bufs.iter().enumerate() {
            for (j, e) in entries.iter().enumerate() {
                let Some(r) = &e.local else { continue };
                let (i, bytes) = (k * entries.len() + j, f32_bytes(&buf[r.clone()]));
                if !e.replicated {
                    pieces.push((i, Slice::full(&e.shape), bytes));
                } else if let Some((s, b)) = row_piece(&tensors[i], bytes, rank, ep) {
                    pieces.push((i, s, b));
                }
            }
        }
        pieces
    }

    /// An error on every rank whose `ok` is true when any rank's is false.
    fn agree(&self, step: u64, ok: bool, what: &str) -> Result<()> {
        let mut n = [i64::from(!ok)];
        self.group().all_reduce(&mut n, ReduceOp::Sum)?;
        if ok && n[0] != 0 {
            return Err(TrainError::Resume {
                step,
                reason: format!(
                    "{} rank(s) of the EP group failed to {what} the checkpoint",
                    n[0]
                ),
            });
        }
        Ok(())
    }

    /// Loads `ckpt` (saved by an MoE run of this config under any EP degree) into this rank:
    /// the tensors it holds are read, the step counters restored and the data source set at
    /// the saved global row cursor. This rank is only changed once everything has been read.
    pub fn restore(&mut self, ckpt: &Checkpoint) -> Result<()> {
        let entries = entries(self.layout());
        let metas = metas(&entries);
        check_tensor_metas(ckpt, &metas)?;
        let run = saved_run_hashed(ckpt, &self.config_hash(), self.config().batch)?;
        let total = self.layout().total;
        let mut bufs = [vec![0f32; total], vec![0f32; total], vec![0f32; total]];
        for (k, buf) in bufs.iter_mut().enumerate() {
            for (j, e) in entries.iter().enumerate() {
                let Some(r) = &e.local else { continue };
                let name = &metas[k * entries.len() + j].name;
                let bytes = ckpt.read_tensor(name)?;
                ckpt::f32_from_bytes(&bytes, &mut buf[r.clone()], name)?;
            }
        }
        self.load_state(bufs, run.optimizer_step, run.step)?;
        self.reset_source(run.loader.as_ref(), run.rows)
    }

    /// Restores this rank from the newest committed step under `dir`; the step, or `None`
    /// when `dir` holds none. Every rank of the group calls it and reads the same step.
    pub fn resume(&mut self, dir: &Path) -> Result<Option<u64>> {
        let Some(ckpt) = newest_committed(dir)? else {
            return Ok(None);
        };
        self.restore(&ckpt)?;
        Ok(Some(ckpt.step()))
    }
}
