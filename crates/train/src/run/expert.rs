//! Mixture-of-experts runs under the one run loop: the model's blocks carry experts
//! ([`model::config::MoeSpec`] in the run's model config), split over `--ep` ranks of the
//! data-parallel axis ([`crate::expert`]). This file holds what is refused before any worker
//! starts ([`check_moe`]) and the run's routing line ([`moe_line`]).
//!
//! Expert parallelism runs over the data-parallel axis: `ep` divides the data-parallel degree,
//! EP groups of `ep` consecutive ranks each splitting the experts (`E / ep` a rank), the ranks
//! holding the same experts in the other groups averaging their gradients; inside pipeline
//! stages `ep` is 1 or the stage's replicas. Under tensor parallelism the experts are whole on
//! every TP rank (each runs them on the same rows). Experts under sequence parallelism, in
//! tensor-parallel pipeline stages or under ZeRO are not built yet.
use super::config::{RunConfig, refused};
use super::engine::Engine;
use crate::error::Result;

/// Refuses, before any worker starts, what a run with experts does not build for a job of
/// `world` ranks, with the reason and the equation.
pub fn check_moe(cfg: &RunConfig, world: usize) -> Result<()> {
    let (l, t) = (&cfg.layout, &cfg.train);
    let Some(m) = t.model.moe else {
        if l.ep > 1 {
            return Err(refused(format!(
                "--ep {} needs --experts E (a mixture-of-experts model); without it the model is \
                 dense",
                l.ep
            )));
        }
        return Ok(());
    };
    t.model.validate().map_err(|e| refused(e.to_string()))?;
    let e = m.experts;
    let not_built = [
        (l.sp, "--sp".into()),
        (l.tp > 1 && l.pp > 1, format!("--tp {} --pp {}", l.tp, l.pp)),
        (l.zero != 0, format!("--zero {}", l.zero)),
        (
            l.hybrid != (None, None),
            "--dp-shard / --dp-replicate".into(),
        ),
    ];
    if let Some((_, what)) = not_built.into_iter().find(|(bad, _)| *bad) {
        return Err(refused(format!(
            "{what} with --experts {e}: experts under sequence parallelism, in tensor-parallel \
             pipeline stages or under ZeRO are not built yet (they run with data, tensor or \
             pipeline parallelism)"
        )));
    }
    let mp = l.tp * l.pp;
    let dp = world / mp.max(1);
    if l.ep == 0 || !dp.is_multiple_of(l.ep) {
        return Err(refused(format!(
            "--ep {} must divide the data-parallel degree {dp} (nproc x nnodes / (tp x pp) = \
             {world} / {mp}; dp % ep == 0)",
            l.ep
        )));
    }
    if l.pp > 1 && l.ep != 1 && l.ep != dp {
        return Err(refused(format!(
            "--ep {} with --pp {}: inside pipeline stages the experts split over all {dp} \
             replicas of a stage (--ep {dp}); expert groups inside them are not built yet",
            l.ep, l.pp
        )));
    }
    if l.ep > 1 && l.pp > 1 && l.schedule.virtual_stages() > 1 {
        return Err(refused(format!(
            "--ep {} with an interleaved pipeline schedule: experts in pipeline stages need the \
             bucketed reduction of one-chunk schedules (1f1b, gpipe)",
            l.ep
        )));
    }
    if !e.is_multiple_of(l.ep) {
        return Err(refused(format!(
            "--experts {e} with --ep {}: experts % ep = {} != 0, every rank holds E / ep experts",
            l.ep,
            e % l.ep
        )));
    }
    if cfg.export_hf.is_some() {
        return Err(refused(format!(
            "--export-hf with --experts {e}: Hugging Face's GPT-2 and Llama classes hold dense \
             MLPs, so an MoE model has no export there; --save keeps it in Flotilla's format"
        )));
    }
    Ok(())
}

/// The run's MoE line (None for a dense model): experts, k, the EP degree, the whole model's
/// parameters, the last step's aux loss summed over the blocks and the assignments dropped by
/// capacity in it.
pub fn moe_line(cfg: &RunConfig, engine: &Engine) -> Option<String> {
    let m = cfg.train.model.moe?;
    let stats = engine.moe_stats();
    let aux: f64 = stats.iter().map(|s| s.aux_loss).sum();
    let dropped: usize = stats.iter().map(|s| s.dropped_assignments).sum();
    let routed: usize = stats.iter().map(|s| s.routed.iter().sum::<usize>()).sum();
    let whole = model::layout::Layout::new(&cfg.train.model).total;
    Some(format!(
        "# moe: {} experts, top-{}, capacity factor {}, ep {}: {:.2}M parameters; last step's aux \
         loss {aux:.4} (x{} in the objective); {dropped} of {routed} assignments dropped by \
         capacity ({:.2} %)",
        m.experts,
        m.top_k,
        m.capacity_factor,
        cfg.layout.ep,
        whole as f64 / 1e6,
        m.aux_weight,
        100.0 * dropped as f64 / routed.max(1) as f64
    ))
}
