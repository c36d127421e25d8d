//! The planner's forecast of one MoE step on this rank (issue 27: plan beside actual under
//! every layout), built as the dense forecast is ([`crate::forecast`]):
//! - compute: the whole decoder's forward and backward timed on this machine in a one-rank
//!   group holding every expert, on this rank's rows (every rank probes at once, so the cores
//!   are shared as in training). With balanced routing a rank's experts see `N·k` token rows
//!   under any `ep`, as the one-rank model's experts do, so the probe is the rank's compute;
//! - the expert all-to-alls (000 F50: each direction moves `N·k·C` elements per layer;
//!   dispatch and combine forward, both again backward) and the routing counts' all-gather,
//!   priced from the EP group's alpha-beta model; they run inside the layers, so they count
//!   as compute, as the step measures them;
//! - after the backward: the dense gradients' all-reduce over the group (the step's measured
//!   communication), the norm's and the loss's gathers, and AdamW over the rank's parameters.
use std::time::Instant;

use comm::OpKind;
use comm::group::{GroupConfig, ProcessGroup};
use comm::local::LocalRendezvous;
use model::optim::AdamW;

use super::{MoeModel, MoeModelLayout, MoeTrainer};
use crate::error::Result;
use crate::forecast::probe::probe_tokens;
use crate::forecast::{Forecast, ms};

/// Timed repetitions of the probe (after one untimed), the median kept.
const REPS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

impl MoeTrainer {
    /// Probes the decoder's compute (forward + backward of this rank's rows in a one-rank
    /// group), the update per parameter and a copy per byte (a checkpoint's snapshot):
    /// (compute seconds, update seconds per parameter, copy seconds per byte).
    fn probe(&self) -> Result<(f64, f64, f64)> {
        let c = &self.cfg;
        let local = LocalRendezvous::start()?;
        let one = ProcessGroup::new(&local.rdv, "moe-probe", 0, 1, GroupConfig::default())?;
        let mut m = MoeModel::new(c.model, one, c.batch, c.seq_len)?;
        let p = MoeModelLayout::init_whole(c.model, c.seed)?;
        let mut g = vec![0f32; p.len()];
        let n = c.batch * c.seq_len;
        let (tokens, targets) = probe_tokens(c.seed, c.model.vocab, n);
        let mut times = Vec::with_capacity(REPS);
        for rep in 0..=REPS {
            let t = Instant::now();
            m.forward(&self.th, &p, &tokens, &targets)?;
            m.backward(&self.th, &p, &mut g)?;
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        let mut params = self.params.clone();
        let mut opt = AdamW::new(c.adamw, params.len())?;
        let whole = 0..params.len();
        let all = std::slice::from_ref(&whole);
        let (mut update, mut copy) = (Vec::with_capacity(REPS), Vec::with_capacity(REPS));
        let mut staging = vec![0f32; params.len()];
        let len = params.len().max(1) as f64;
        for rep in 0..=REPS {
            let t = Instant::now();
            opt.step(&self.th, &mut params, &self.grads, 0.0, all)?;
            let dt = t.elapsed().as_secs_f64();
            let t = Instant::now();
            staging.copy_from_slice(&params);
            std::hint::black_box(&staging);
            if rep > 0 {
                update.push(dt / len);
                copy.push(t.elapsed().as_secs_f64() / (4.0 * len));
            }
        }
        Ok((median(times), median(update), median(copy)))
    }

    /// Forecasts one step of this rank (see the module doc): a collective over the group
    /// (the probe's times are the ranks' mean).
    pub fn forecast(&self) -> Result<Forecast> {
        let g = &self.group;
        g.barrier()?;
        let (compute, per_param, per_byte) = self.probe()?;
        let mut v = [compute, per_param, per_byte];
        g.all_reduce(&mut v, comm::ReduceOp::Sum)?;
        let [compute, per_param, per_byte] = v.map(|x| x / g.size() as f64);
        let l = self.layout();
        let m = &l.cfg.moe;
        let (ep, layers) = (g.size(), l.cfg.layers);
        let price = |kind, bytes: usize| {
            if ep > 1 {
                g.explain(kind, bytes).predicted_s.unwrap_or(0.0)
            } else {
                0.0
            }
        };
        let n = self.cfg.batch * self.cfg.seq_len;
        let a2a_bytes = 4 * n * m.top_k * m.channels;
        let a2a = price(OpKind::AllToAll, a2a_bytes);
        let counts = price(OpKind::AllGather, 8 * (m.experts + 2) * ep);
        let exchanges = layers as f64 * (4.0 * a2a + counts);
        let dense = price(OpKind::AllReduce, 4 * l.dense);
        let gathers = price(OpKind::AllGather, 8 * ep) + price(OpKind::AllGather, 8 * ep);
        let update = l.total as f64 * per_param;
        let compute_all = compute + exchanges + gathers + update;
        let step = compute_all + dense;
        let explain = vec![
            format!(
                "forward + backward of the decoder on {} rows x {} tokens with all {} experts \
                 (one-rank group, probed) = {}",
                self.cfg.batch,
                self.cfg.seq_len,
                m.experts,
                ms(compute)
            ),
            format!(
                "expert exchanges over ep {ep}: {layers} layers x (4 all-to-alls of {} KB at {} \
                 + counts {}) = {} (000 F50; inside the layers, counted as compute)",
                a2a_bytes / 1000,
                ms(a2a),
                ms(counts),
                ms(exchanges)
            ),
            format!(
                "dense gradients' all-reduce of {} params {}; loss and norm gathers {}; update \
                 {} params x {:.2} ns = {}",
                l.dense,
                ms(dense),
                ms(gathers),
                l.total,
                per_param * 1e9,
                ms(update)
            ),
        ];
        Ok(Forecast {
            compute: compute_all,
            comm: dense,
            exposed: dense,
            data: 0.0,
            step,
            // A checkpoint snapshots this rank's parameters and both moments.
            ckpt_pause: (12 * l.total) as f64 * per_byte,
            explain,
        })
    }
}
