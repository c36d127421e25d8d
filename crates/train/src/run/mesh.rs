//! The planner's view of a mesh run (issue 8): its layout evaluated on this machine's
//! measured numbers, and the linter's warnings, printed before the first step and set beside
//! the measurement at the end.
use comm::group::ProcessGroup;
use comm::mesh::MeshShape;
use comm::transport::LinkKind;

use crate::config::TrainConfig;
use crate::error::Result;
use crate::planner::calibrate::{cluster_file, for_run};

/// The planner's evaluation of a `shape` run of `cfg` over `group` on `nodes` nodes of
/// `group.size() / nodes` ranks (shared memory inside a node and TCP between nodes, as the
/// group measured them), with each rank's GEMM peak `peak_gflops` and ZeRO `zero` over the
/// data-parallel axis; and the linter's warnings.
pub fn planner_view(
    cfg: &TrainConfig,
    zero: u8,
    shape: MeshShape,
    group: &ProcessGroup,
    nodes: usize,
    peak_gflops: f64,
) -> Result<(plan::step::Evaluation, Vec<plan::lint::Warning>)> {
    let topo = group.topology();
    let (shm, tcp) = (topo.params(LinkKind::Shm), topo.params(LinkKind::Tcp));
    let ranks = group.size();
    let c = for_run(
        (ranks / nodes.max(1)).max(1) as u64,
        cfg.threads,
        peak_gflops * 1e9,
        (shm.alpha, shm.beta),
        (tcp.alpha, tcp.beta),
    );
    let mut file = cluster_file(&c);
    file.nodes = nodes as u64;
    let cluster = plan::cluster::Cluster::from_file(&file)?;
    let job = crate::planner::job(
        &cfg.model,
        cfg.seq_len,
        shape.dp * cfg.batch * cfg.grad_accum,
    )?;
    let layout = plan::layout::Layout {
        micro_batch: cfg.batch as u64,
        sequence_parallel: false,
        vocab_parallel: false,
        zero: plan::layout::ZeroStage::try_from(zero).map_err(|reason| {
            crate::TrainError::Config {
                field: "zero",
                value: zero.to_string(),
                reason,
            }
        })?,
        ..plan::layout::Layout::new(shape.tp as u64, shape.pp as u64, shape.dp as u64)
    };
    let e = plan::step::evaluate(&job, &cluster, &layout)?;
    let warnings = plan::lint::lint(&job, &cluster, &e, &plan::lint::LintConfig::default());
    Ok((e, warnings))
}
