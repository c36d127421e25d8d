//! The [`Trainer`] with its experts split over its data-parallel ranks (DP x EP, `ep` = the
//! data-parallel degree): the one model built for this rank's experts ([`Model::parts`]), the
//! other experts' ranges zeroed, the gradient buckets cut around every expert's range (each
//! expert's gradient already holds every rank's tokens, [`model::moe::Objective::Mean`]), the
//! norm adding the owners' squares, and checkpoints writing each expert from its owner.
use model::model::Model;
use model::optim::Bf16Store;

use super::{ExpertPart, cut_out};
use crate::checkpoint::row_piece;
use crate::config::TrainConfig;
use crate::ddp::{GradBuckets, plan_buckets};
use crate::error::{Result, TrainError};
use crate::trainer::Trainer;
use crate::zero::state::StatePiece;
use ckpt::{Slice, TensorMeta};
use comm::group::ProcessGroup;

fn refuse(reason: String) -> TrainError {
    TrainError::Config {
        field: "expert_parallel",
        value: "ep".into(),
        reason,
    }
}

impl Trainer {
    /// One rank of data-parallel training over `group` whose experts are split over EP groups
    /// of `ep` consecutive ranks (expert parallelism over the data-parallel axis; 000
    /// "专家并行"): each rank computes `E / ep` experts of every block on its EP group's tokens
    /// routed to them, exchanging rows with all-to-alls; the dense tensors and routers are
    /// data-parallel replicas reduced in buckets of `bucket_bytes`, each expert's gradient is
    /// averaged over the ranks holding it in the other EP groups ([`super::expert_groups`]).
    /// Refuses a dense model and `ep` not dividing the group.
    pub fn expert_parallel(
        cfg: TrainConfig,
        group: ProcessGroup,
        ep: usize,
        bucket_bytes: usize,
    ) -> Result<Self> {
        Self::data_parallel(cfg, group.clone(), bucket_bytes)?.with_experts(group, ep, bucket_bytes)
    }

    /// This data-parallel trainer (whole, or split over its TP group: [`Trainer::on_mesh`])
    /// with its model rebuilt for its rank's experts over the data-parallel `group` (its
    /// replicas) in EP groups of `ep` (see the module doc): [`Trainer::expert_parallel`], and DP
    /// x TP x EP on a mesh, the experts whole on every TP rank and the EP groups inside each TP
    /// index's data-parallel group. Refuses a dense model, ZeRO, sequence parallelism and `ep`
    /// not dividing the group.
    pub fn with_experts(
        mut self,
        group: ProcessGroup,
        ep: usize,
        bucket_bytes: usize,
    ) -> Result<Self> {
        self.split_experts(group, ep, bucket_bytes)?;
        Ok(self)
    }

    fn split_experts(&mut self, group: ProcessGroup, ep: usize, bucket_bytes: usize) -> Result<()> {
        let cfg = self.config().clone();
        if cfg.model.moe.is_none() {
            return Err(refuse("the model has no experts (--experts E)".into()));
        }
        if self.zero_stage().is_some() || self.tensor.as_ref().is_some_and(|t| t.sequence) {
            return Err(refuse(
                "experts under ZeRO or sequence parallelism are not built yet".into(),
            ));
        }
        let (ep_group, replicas) = super::expert_groups(&group, ep)?;
        let rank = ep_group.rank();
        let recompute = vec![cfg.recompute; cfg.model.layers];
        let rows = (cfg.batch, cfg.seq_len);
        let split = self
            .tensor
            .as_ref()
            .map_or((1, false), |t| (t.tp(), t.sequence));
        self.model = Model::parts(&cfg.model, rows, recompute, split, (ep, rank), false)?;
        let part = ExpertPart::new(self.model.layout(), ep_group).with_replicas(replicas);
        for r in cut_out(&part.all, &part.owned) {
            self.params.release(r.clone());
            self.grads.release(r);
        }
        if self.bf16.is_some() {
            let store = Bf16Store::new(self.params.to_vec());
            store.decode_params(&mut self.params)?;
            self.bf16 = Some(store);
        }
        let buckets = plan_buckets(self.model.layout(), bucket_bytes);
        let mut sync = GradBuckets::over(group, part.dense_buckets(&buckets), self.params.len());
        if self.tensor.is_some() {
            sync = sync.with_options(crate::tensor::PINNED);
        }
        self.sync = Some(sync);
        self.experts = Some(part);
        Ok(())
    }

    /// Which of the layout's entries this rank writes whole (its experts: `Some(true)`), which
    /// it leaves to their owners (`Some(false)`) and which the ranks share by rows (`None`).
    pub(crate) fn expert_owners(&self) -> Vec<Option<bool>> {
        let layout = self.model().layout();
        layout
            .entries
            .iter()
            .map(|e| match &self.experts {
                Some(p) if e.expert.is_some() => p.owns(e.offset),
                _ => None,
            })
            .collect()
    }
}

/// This rank's pieces of `views` (the state tensors: every layout entry under each prefix),
/// `owners` as [`Trainer::expert_owners`] gives them: an owned expert whole, another rank's
/// expert nothing, the rest by rows ([`ckpt::rank_rows`] of `rank` among `world`).
pub(crate) fn share_pieces<'a>(
    views: &[(TensorMeta, &'a [u8])],
    owners: &[Option<bool>],
    rank: u32,
    world: u32,
) -> Vec<StatePiece<'a>> {
    let n = owners.len().max(1);
    views
        .iter()
        .enumerate()
        .filter_map(
            |(i, (m, bytes))| match owners.get(i % n).copied().flatten() {
                Some(true) => {
                    let whole: Vec<(u64, u64)> = m.shape.iter().map(|&d| (0, d)).collect();
                    Some((i, Slice::new(&whole), *bytes))
                }
                Some(false) => None,
                None => row_piece(m, bytes, rank, world).map(|(s, b)| (i, s, b)),
            },
        )
        .collect()
}
