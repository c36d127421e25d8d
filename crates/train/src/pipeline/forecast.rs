//! The planner's forecast of one pipeline step, as this stage sees it (issue 27: plan beside
//! actual under every layout; the data-parallel forecast is [`crate::forecast::forecast`]).
//!
//! Built from the same parts as the data-parallel forecast:
//! - the probe's per-unit times ([`UnitTimes`], measured on this machine with the stage's TP
//!   shard shapes), summed over each stage's units (000 Algorithm 1 step 1's partition), with
//!   each block's tensor-parallel sums priced from the TP group's alpha-beta model;
//! - the schedule's own list replayed on an event timeline ([`Schedule::simulate`], 000 F41),
//!   each message between stages priced `alpha + n/beta` (004 eq. 28.10) on the pipeline
//!   group's link: the makespan holds the bubble and the transfers;
//! - after the schedule, what [`PipelineStage::step`]'s update issues: the tied embedding's
//!   all-reduce between the first and last stage, the data-parallel all-reduce of every owned
//!   range (and under ZeRO-1 the all-gather of the stepped shards), the gradient norm's
//!   scalar sums, and AdamW over the owned (or ZeRO-1 sharded) parameters.
//!
//! The rows match what a stage measures: its time blocked in sends and receives is its
//! exposed communication (the bubble and transfers); everything else, the update's
//! collectives included, is its compute.
use comm::OpKind;
use comm::group::ProcessGroup;
use model::layout::Unit;

use super::build::{chunk_units, config_err};
use super::engine::PipelineStage;
use crate::error::Result;
use crate::forecast::{Forecast, UnitTimes, block_sums, expert_exchanges, ms};

impl PipelineStage {
    /// The units stage `s` runs (its chunks `c p + s`, `c` in `0..v`), in forward order.
    fn units_of(&self, s: usize) -> Vec<Unit> {
        let (p, v) = (
            self.schedule.stages(),
            self.schedule.virtual_stages().max(1),
        );
        (0..v)
            .flat_map(|c| chunk_units(self.cfg.model.layers, p * v, c * p + s))
            .collect()
    }

    /// Bytes of one message between stages: the residual stream (N, C) f32, or under sequence
    /// parallelism this TP rank's rows of it.
    fn message_bytes(&self) -> usize {
        let rows = match &self.tensor {
            Some(t) if t.sequence => t.group.size(),
            _ => 1,
        };
        4 * self.cfg.micro_tokens() * self.cfg.model.d_model / rows
    }

    /// Forecasts one step of this stage from `probe` (see the module doc).
    pub fn forecast(&self, probe: &UnitTimes) -> Result<Forecast> {
        let (p, m) = (self.schedule.stages(), self.schedule.microbatches());
        let (tp_fwd, tp_bwd) = match &self.tensor {
            Some(t) => block_sums(
                &t.group,
                t.sequence,
                self.cfg.micro_tokens() * self.cfg.model.d_model,
                self.cfg.recompute,
            ),
            None => (0.0, 0.0),
        };
        let (ep_fwd, ep_bwd) = expert_exchanges(
            self.experts.as_ref(),
            self.cfg.model.moe_layer(),
            self.cfg.micro_tokens(),
            self.cfg.recompute,
        );
        let (tp_fwd, tp_bwd) = (tp_fwd + ep_fwd, tp_bwd + ep_bwd);
        let time = |units: &[Unit], backward: bool| -> f64 {
            units
                .iter()
                .map(|&u| match (u, backward) {
                    (Unit::Block(_), false) => probe.forward(u) + tp_fwd,
                    (Unit::Block(_), true) => probe.backward(u) + tp_bwd,
                    (_, false) => probe.forward(u),
                    (_, true) => probe.backward(u),
                })
                .sum()
        };
        let stages: Vec<Vec<Unit>> = (0..p).map(|s| self.units_of(s)).collect();
        let fwd: Vec<f64> = stages.iter().map(|u| time(u, false)).collect();
        let bwd: Vec<f64> = stages.iter().map(|u| time(u, true)).collect();
        let bytes = self.message_bytes();
        let hop = self.group.topology().flat().msg(bytes as f64);
        let timeline = self
            .schedule
            .simulate(&fwd, &bwd, hop)
            .map_err(|e| config_err("forecast", "the probed unit times", e.to_string()))?;
        let s = self.stage();
        let busy = timeline.busy(s);

        // After the schedule: what the update issues, in its order.
        let price = |g: &ProcessGroup, kind, bytes: usize| {
            if g.size() > 1 {
                g.explain(kind, bytes).predicted_s.unwrap_or(0.0)
            } else {
                0.0
            }
        };
        let tied = self
            .tied
            .as_ref()
            .map_or(0.0, |w| price(&self.group, OpKind::AllReduce, 4 * w.len()));
        let (mut reduce, mut gather) = (0.0, 0.0);
        if let Some(dp) = &self.dp {
            for u in &self.updates {
                reduce += price(dp, OpKind::AllReduce, 4 * u.part.range.len());
                if self.zero {
                    gather += price(dp, OpKind::AllGather, 4 * u.part.range.len());
                }
            }
        }
        // The norm: its sums of squares over the pipeline (and TP) group, one scalar each.
        let scalars = price(&self.group, OpKind::AllReduce, 8)
            + self
                .tensor
                .as_ref()
                .map_or(0.0, |t| price(&t.group, OpKind::AllReduce, 8));
        let stepped: usize = self.updates.iter().map(|u| u.part.shard.len()).sum();
        let update = stepped as f64 * probe.update_per_param;
        let after = tied + reduce + gather + scalars + update;
        let compute = busy + after;
        let step = timeline.makespan + after;
        let owned: usize = self.updates.iter().map(|u| u.part.range.len()).sum();
        let unit_list = |units: &[Unit]| {
            let blocks = units.iter().filter(|u| matches!(u, Unit::Block(_))).count();
            let mut parts = vec![format!("{blocks} blocks")];
            if units.contains(&Unit::Embed) {
                parts.insert(0, "embed".into());
            }
            if units.contains(&Unit::Head) {
                parts.push("head".into());
            }
            parts.join(" + ")
        };
        let mut explain = vec![format!(
            "stages' units per micro-batch (forward + backward{}): {}",
            match (self.tensor.is_some(), ep_fwd > 0.0) {
                (true, _) => ", with each block's tensor-parallel sums",
                (false, true) => ", with each block's expert exchanges (000 F50)",
                (false, false) => "",
            },
            (0..p)
                .map(|i| format!(
                    "stage {i} {} = {} + {}",
                    unit_list(&stages[i]),
                    ms(fwd[i]),
                    ms(bwd[i])
                ))
                .collect::<Vec<_>>()
                .join("; ")
        )];
        explain.push(format!(
            "{:?} schedule of {m} micro-batches over {p} stages, messages of {} KB at {} each \
             (alpha-beta of the pipeline link): makespan {}, this stage (stage {s}) busy {}, \
             bubble {:.1} % (000 F41)",
            self.schedule.kind(),
            bytes / 1000,
            ms(hop),
            ms(timeline.makespan),
            ms(busy),
            100.0 * timeline.bubble_fraction()
        ));
        explain.push(format!(
            "after the schedule: tied embedding sum {}, data-parallel all-reduce of {owned} \
             params {}{}, norm sums {}, update {stepped} params x {:.2} ns = {}",
            ms(tied),
            ms(reduce),
            if self.zero {
                format!(" and ZeRO-1 all-gather {}", ms(gather))
            } else {
                String::new()
            },
            ms(scalars),
            probe.update_per_param * 1e9,
            ms(update)
        ));
        Ok(Forecast {
            compute,
            comm: step - compute,
            exposed: step - compute,
            data: 0.0,
            step,
            // A checkpoint snapshots this stage's parameters and both moments.
            ckpt_pause: (4 * owned + 8 * stepped) as f64 * probe.copy_per_byte,
            explain,
        })
    }
}
