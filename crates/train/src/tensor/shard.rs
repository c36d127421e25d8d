//! Megatron sharding of one block's flat parameters over a tensor-parallel
//! group (000 §2.15, Fig 5.14), and its inverse.
//!
//! Rank `r` of `tp` keeps (whole shapes from [`BlockLayout`]):
//!
//! ```text
//! tensor            whole             rank r's shard                      kind
//! ln1_w, ln1_b      (C)               (C)                                 replicated
//! qkv_w             ((H+2K)D, C)      rows of q heads [r·H/tp, (r+1)·H/tp) column-parallel
//!                                     | k heads [r·K/tp, ..) | v heads likewise
//! qkv_b             ((H+2K)D)         the same rows                       column-parallel
//! proj_w            (C, HD)           columns [r·HD/tp, (r+1)·HD/tp)      row-parallel
//! proj_b            (C)               (C), added once after the all-reduce replicated
//! ln2_w, ln2_b      (C)               (C)                                 replicated
//! fc_w              (F or 2F, C)      rows [r·F/tp, ..) (SwiGLU: of gate  column-parallel
//!                                     and of up, gate first)
//! fc_b              (F or 2F)         the same rows                       column-parallel
//! fcp_w             (C, F)            columns [r·F/tp, (r+1)·F/tp)        row-parallel
//! fcp_b             (C)               (C), added once after the all-reduce replicated
//! ```
//!
//! A shard is laid out like a block of the narrower model (H/tp query heads,
//! K/tp kv heads, F/tp feed-forward width, same C and D), in the whole
//! block's tensor order, so the model crate's kernels run on it unchanged.
//! Since the shard keeps whole heads and H/tp ÷ K/tp = H/K, local query head
//! `j` still reads local kv head `j / (H/K)` (GQA groups never straddle ranks).
use crate::error::{Result, TrainError};
use model::block::Dims;
use model::config::{Activation, ModelConfig};
use model::layout::BlockLayout;
use std::ops::Range;

/// One contiguous copy between the whole block and a shard: `len` elements
/// at `whole` (relative to the block) and at `local` (relative to the shard).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seg {
    whole: usize,
    local: usize,
    len: usize,
    /// Replicated on every rank (norms, row-parallel biases): gathered from
    /// rank 0 only.
    replicated: bool,
}

/// Where rank `rank` of a `tp`-way group finds its part of one block: the
/// shard's own [`BlockLayout`] and [`Dims`], and the copy plan between the
/// whole block and the shard.
#[derive(Clone, Debug)]
pub struct TpShard {
    /// Tensor-parallel degree (1: no split).
    pub tp: usize,
    /// This rank's index in the tensor-parallel group, `0..tp`.
    pub rank: usize,
    /// The whole block's layout (relative offsets, length `whole.size`).
    pub whole: BlockLayout,
    /// The shard's layout (relative offsets, length `local.size`).
    pub local: BlockLayout,
    /// The shard's dimensions at batch `b`, length `t`: `h` = H/tp, `k` =
    /// K/tp, `qkv` = (H+2K)D/tp, `f` = F/tp, `fin` = Fin/tp; `c`, `d`, `n`
    /// as in the whole block.
    pub dims: Dims,
    segs: Vec<Seg>,
}

fn tp_error(value: usize, reason: String) -> TrainError {
    TrainError::Config {
        field: "tp",
        value: value.to_string(),
        reason,
    }
}

/// Checks that `tp` can split a block of `cfg` (000 §2.15: whole heads per
/// rank): `tp ≥ 1` and it divides `heads`, `kv_heads` and `ffn`. The error
/// names the field and states the equation with its values.
pub fn check_tp(cfg: &ModelConfig, tp: usize) -> Result<()> {
    cfg.check_split(tp).map_err(|e| match e {
        model::ModelError::Config { reason, .. } => tp_error(tp, reason),
        other => other.into(),
    })
}

impl TpShard {
    /// The shard of rank `rank` in a `tp`-way group, for blocks of `cfg`
    /// (whose layout is `whole`) run at batch `b` and length `t`.
    ///
    /// Refuses `tp` not dividing heads, kv_heads or ffn ([`check_tp`]),
    /// `rank ≥ tp`, and a `whole` layout whose tensor sizes disagree with
    /// `cfg`.
    pub fn new(
        cfg: &ModelConfig,
        whole: &BlockLayout,
        tp: usize,
        rank: usize,
        b: usize,
        t: usize,
    ) -> Result<Self> {
        check_tp(cfg, tp)?;
        if rank >= tp {
            return Err(TrainError::Config {
                field: "tp rank",
                value: rank.to_string(),
                reason: format!("rank ({rank}) must be < tp ({tp})"),
            });
        }
        let wd = Dims::new(cfg, b, t);
        let (c, d) = (wd.c, wd.d);
        let expect = |what: &'static str, r: &Range<usize>, len: usize| -> Result<()> {
            if r.len() == len {
                Ok(())
            } else {
                Err(TrainError::Model(model::ModelError::Shape {
                    what,
                    expected: len,
                    got: r.len(),
                }))
            }
        };
        expect("block layout qkv_w", &whole.qkv_w, wd.qkv * c)?;
        expect("block layout proj_w", &whole.proj_w, c * wd.h * d)?;
        expect("block layout fc_w", &whole.fc_w, wd.fin * c)?;
        expect("block layout fcp_w", &whole.fcp_w, c * wd.f)?;
        expect("block layout ln1_w", &whole.ln1_w, c)?;
        expect("block layout ln2_w", &whole.ln2_w, c)?;
        for (what, r, len) in [
            ("block layout ln1_b", &whole.ln1_b, c),
            ("block layout qkv_b", &whole.qkv_b, wd.qkv),
            ("block layout proj_b", &whole.proj_b, c),
            ("block layout ln2_b", &whole.ln2_b, c),
            ("block layout fc_b", &whole.fc_b, wd.fin),
            ("block layout fcp_b", &whole.fcp_b, c),
        ] {
            if let Some(r) = r {
                expect(what, r, len)?;
            }
        }
        let ends = [
            &whole.ln1_w,
            &whole.qkv_w,
            &whole.proj_w,
            &whole.ln2_w,
            &whole.fc_w,
        ]
        .into_iter()
        .chain([&whole.fcp_w])
        .chain(whole.moe.as_ref())
        .map(|r| r.end)
        .max()
        .unwrap_or(0);
        let bias_ends = [&whole.ln1_b, &whole.qkv_b, &whole.proj_b, &whole.ln2_b]
            .into_iter()
            .chain([&whole.fc_b, &whole.fcp_b])
            .flatten()
            .map(|r| r.end)
            .max()
            .unwrap_or(0);
        if ends.max(bias_ends) > whole.size {
            return Err(TrainError::Model(model::ModelError::Shape {
                what: "block layout size",
                expected: ends.max(bias_ends),
                got: whole.size,
            }));
        }
        let (hl, kl, fl) = (wd.h / tp, wd.k / tp, wd.f / tp);
        let swiglu = cfg.activation == Activation::SwiGlu;
        let dims = wd.split(tp);
        // Rows (of width `w`) that this rank keeps of the column-parallel
        // tensors, as ranges of whole rows in shard order.
        let qkv_rows = [
            r_range(rank, hl * d, 0),
            r_range(rank, kl * d, wd.h * d),
            r_range(rank, kl * d, (wd.h + wd.k) * d),
        ];
        let mut fc_rows = vec![r_range(rank, fl, 0)];
        if swiglu {
            fc_rows.push(r_range(rank, fl, wd.f));
        }
        // The shard's layout, in the whole block's tensor order.
        let mut order: Vec<(usize, Tensor)> = vec![
            (whole.ln1_w.start, Tensor::Whole(whole.ln1_w.clone())),
            (
                whole.qkv_w.start,
                Tensor::Rows(whole.qkv_w.clone(), c, qkv_rows.to_vec()),
            ),
            (
                whole.proj_w.start,
                Tensor::Cols(whole.proj_w.clone(), wd.h * d, r_range(rank, hl * d, 0)),
            ),
            (whole.ln2_w.start, Tensor::Whole(whole.ln2_w.clone())),
        ];
        match &whole.moe {
            // The experts are whole on every tensor-parallel rank.
            Some(m) => order.push((m.start, Tensor::Whole(m.clone()))),
            None => order.extend([
                (
                    whole.fc_w.start,
                    Tensor::Rows(whole.fc_w.clone(), c, fc_rows.clone()),
                ),
                (
                    whole.fcp_w.start,
                    Tensor::Cols(whole.fcp_w.clone(), wd.f, r_range(rank, fl, 0)),
                ),
            ]),
        }
        for (r, t) in [
            (&whole.ln1_b, None),
            (&whole.qkv_b, Some(qkv_rows.to_vec())),
            (&whole.proj_b, None),
            (&whole.ln2_b, None),
            (&whole.fc_b, Some(fc_rows.clone())),
            (&whole.fcp_b, None),
        ] {
            if let Some(r) = r {
                let tensor = match t {
                    None => Tensor::Whole(r.clone()),
                    Some(rows) => Tensor::Rows(r.clone(), 1, rows),
                };
                order.push((r.start, tensor));
            }
        }
        order.sort_by_key(|(start, _)| *start);
        let mut at = 0;
        let mut segs = Vec::new();
        let mut local_of = Vec::new();
        for (start, tensor) in &order {
            let local_start = at;
            match tensor {
                Tensor::Whole(r) => {
                    segs.push(Seg {
                        whole: r.start,
                        local: at,
                        len: r.len(),
                        replicated: true,
                    });
                    at += r.len();
                }
                Tensor::Rows(r, w, rows) => {
                    for rr in rows {
                        let len = rr.len() * w;
                        segs.push(Seg {
                            whole: r.start + rr.start * w,
                            local: at,
                            len,
                            replicated: false,
                        });
                        at += len;
                    }
                }
                Tensor::Cols(r, w, cols) => {
                    for row in 0..r.len() / w {
                        segs.push(Seg {
                            whole: r.start + row * w + cols.start,
                            local: at,
                            len: cols.len(),
                            replicated: false,
                        });
                        at += cols.len();
                    }
                }
            }
            local_of.push((*start, local_start..at));
        }
        let size = at;
        let find = |r: &Range<usize>| -> Range<usize> {
            local_of
                .iter()
                .find(|(s, _)| *s == r.start)
                .map(|(_, l)| l.clone())
                .unwrap_or(0..0)
        };
        let opt = |r: &Option<Range<usize>>| r.as_ref().map(find);
        let local = BlockLayout {
            ln1_w: find(&whole.ln1_w),
            ln1_b: opt(&whole.ln1_b),
            qkv_w: find(&whole.qkv_w),
            qkv_b: opt(&whole.qkv_b),
            proj_w: find(&whole.proj_w),
            proj_b: opt(&whole.proj_b),
            ln2_w: find(&whole.ln2_w),
            ln2_b: opt(&whole.ln2_b),
            fc_w: find(&whole.fc_w),
            fc_b: opt(&whole.fc_b),
            fcp_w: find(&whole.fcp_w),
            fcp_b: opt(&whole.fcp_b),
            moe: opt(&whole.moe),
            size,
        };
        Ok(Self {
            tp,
            rank,
            whole: whole.clone(),
            local,
            dims,
            segs,
        })
    }

    /// Copies this rank's shard (length `local.size`) out of the whole
    /// block `whole` (length `whole.size`).
    pub fn shard<T: Copy>(&self, whole: &[T], out: &mut [T]) -> Result<()> {
        check_len("whole block", whole.len(), self.whole.size)?;
        check_len("block shard", out.len(), self.local.size)?;
        for s in &self.segs {
            out[s.local..s.local + s.len].copy_from_slice(&whole[s.whole..s.whole + s.len]);
        }
        Ok(())
    }

    /// [`shard`](Self::shard) into a new vector.
    pub fn shard_vec<T: Copy + Default>(&self, whole: &[T]) -> Result<Vec<T>> {
        let mut out = vec![T::default(); self.local.size];
        self.shard(whole, &mut out)?;
        Ok(out)
    }

    /// Writes this rank's shard `local` back into its place in `whole`.
    /// Replicated tensors (norms, row-parallel biases) are written by rank 0
    /// only, so gathering every rank's shard takes them from rank 0.
    pub fn unshard<T: Copy>(&self, local: &[T], whole: &mut [T]) -> Result<()> {
        check_len("block shard", local.len(), self.local.size)?;
        check_len("whole block", whole.len(), self.whole.size)?;
        for s in &self.segs {
            if s.replicated && self.rank != 0 {
                continue;
            }
            whole[s.whole..s.whole + s.len].copy_from_slice(&local[s.local..s.local + s.len]);
        }
        Ok(())
    }
}

/// The whole block (length `whole.size`) from every rank's shard, in rank
/// order: `shards[r]` is rank `r`'s (from [`TpShard::shard`] or its
/// gradients). For checks and checkpoints.
pub fn gather<T: Copy + Default>(plans: &[TpShard], shards: &[&[T]]) -> Result<Vec<T>> {
    let Some(first) = plans.first() else {
        return Err(tp_error(0, "gather needs at least one shard".into()));
    };
    if plans.len() != first.tp || shards.len() != first.tp {
        return Err(tp_error(
            first.tp,
            format!(
                "gather needs tp ({}) plans and shards, got {} and {}",
                first.tp,
                plans.len(),
                shards.len()
            ),
        ));
    }
    let mut whole = vec![T::default(); first.whole.size];
    for (r, (p, s)) in plans.iter().zip(shards).enumerate() {
        if p.rank != r || p.tp != first.tp || p.whole != first.whole {
            return Err(tp_error(
                p.tp,
                format!("gather: plan {r} is rank {} of {}", p.rank, p.tp),
            ));
        }
        p.unshard(s, &mut whole)?;
    }
    Ok(whole)
}

/// Rank `rank`'s slice of `len` rows starting at `base`: `base + rank·len ..`.
fn r_range(rank: usize, len: usize, base: usize) -> Range<usize> {
    base + rank * len..base + (rank + 1) * len
}

/// One tensor of the whole block and what this rank keeps of it.
enum Tensor {
    /// Replicated whole.
    Whole(Range<usize>),
    /// These whole-row ranges of a (rows, w) matrix (w = 1: a bias).
    Rows(Range<usize>, usize, Vec<Range<usize>>),
    /// These columns of every row of a (rows, w) matrix.
    Cols(Range<usize>, usize, Range<usize>),
}

/// Refuses a buffer of the wrong length.
pub(crate) fn check_len(what: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(TrainError::Model(model::ModelError::Shape {
            what,
            expected,
            got,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::layout::Layout;

    fn plans(cfg: &ModelConfig, tp: usize) -> Vec<TpShard> {
        let l = Layout::new(cfg);
        (0..tp)
            .map(|r| TpShard::new(cfg, &l.block, tp, r, 2, 8).unwrap())
            .collect()
    }

    fn configs() -> Vec<ModelConfig> {
        vec![
            ModelConfig::gpt2(1, 4, 64, 16, 32),
            ModelConfig::llama(1, 4, 2, 64, 96, 16, 32),
        ]
    }

    #[test]
    fn shard_then_gather_is_identity() {
        for cfg in configs() {
            for tp in [1, 2, 4] {
                if check_tp(&cfg, tp).is_err() {
                    continue;
                }
                let ps = plans(&cfg, tp);
                let whole: Vec<f32> = (0..ps[0].whole.size).map(|i| i as f32).collect();
                let shards: Vec<Vec<f32>> =
                    ps.iter().map(|p| p.shard_vec(&whole).unwrap()).collect();
                let refs: Vec<&[f32]> = shards.iter().map(|s| s.as_slice()).collect();
                assert_eq!(gather(&ps, &refs).unwrap(), whole, "tp {tp}");
                // Each non-replicated element lives on exactly one rank.
                let total: usize = shards.iter().map(|s| s.len()).sum();
                let l = &ps[0].whole;
                let replicated: usize = [&l.ln1_b, &l.proj_b, &l.ln2_b, &l.fcp_b]
                    .iter()
                    .filter_map(|r| r.as_ref().map(|r| r.len()))
                    .sum::<usize>()
                    + l.ln1_w.len()
                    + l.ln2_w.len();
                assert_eq!(total, l.size + (tp - 1) * replicated);
            }
        }
    }

    #[test]
    fn tp1_is_identity() {
        for cfg in configs() {
            let p = &plans(&cfg, 1)[0];
            assert_eq!(p.local, p.whole);
            let whole: Vec<f32> = (0..p.whole.size).map(|i| i as f32).collect();
            assert_eq!(p.shard_vec(&whole).unwrap(), whole);
        }
    }

    #[test]
    fn qkv_rows_follow_heads() {
        // llama: H=4, K=2, D=16; rank 1 of 2 keeps q heads 2,3, k head 1, v head 1.
        let cfg = ModelConfig::llama(1, 4, 2, 64, 96, 16, 32);
        let p = &plans(&cfg, 2)[1];
        let c = 64;
        let whole: Vec<u32> = (0..p.whole.size as u32).collect();
        let s = p.shard_vec(&whole).unwrap();
        let q = &s[p.local.qkv_w.clone()];
        let row = |i: usize| (p.whole.qkv_w.start + i * c) as u32;
        assert_eq!(q[0], row(32)); // q head 2
        assert_eq!(q[32 * c], row(64 + 16)); // k head 1
        assert_eq!(q[48 * c], row(64 + 32 + 16)); // v head 1
        assert_eq!(p.dims.qkv, 64);
        // fc (SwiGLU): gate rows 48..96, then up rows 96+48..192.
        let fc = &s[p.local.fc_w.clone()];
        let frow = |i: usize| (p.whole.fc_w.start + i * c) as u32;
        assert_eq!(fc[0], frow(48));
        assert_eq!(fc[48 * c], frow(144));
        // fcp: columns 48..96 of each of the C rows.
        let fcp = &s[p.local.fcp_w.clone()];
        assert_eq!(fcp[0], (p.whole.fcp_w.start + 48) as u32);
        assert_eq!(fcp[48], (p.whole.fcp_w.start + 96 + 48) as u32);
    }

    #[test]
    fn refuses_tp_not_dividing_heads() {
        let cfg = ModelConfig::gpt2(1, 4, 64, 16, 32);
        let e = check_tp(&cfg, 3).unwrap_err().to_string();
        assert!(e.contains("heads (4) % tp (3) = 1"), "{e}");
        let cfg = ModelConfig::llama(1, 4, 2, 64, 96, 16, 32);
        let e = check_tp(&cfg, 4).unwrap_err().to_string();
        assert!(e.contains("kv_heads (2) % tp (4) = 2"), "{e}");
        assert!(check_tp(&cfg, 0).is_err());
        let l = Layout::new(&cfg);
        assert!(TpShard::new(&cfg, &l.block, 2, 2, 1, 4).is_err());
        let p = TpShard::new(&cfg, &l.block, 2, 0, 1, 4).unwrap();
        assert!(p.shard::<f32>(&[0.0; 3], &mut [0.0; 3]).is_err());
    }
}
