//! The device mesh: the world's ranks arranged as a (dp, pp, tp) grid, with expert-parallel (ep)
//! groups carved out of the data-parallel axis, and one process group per axis.
//!
//! Hybrid parallelism gives each rank a coordinate in a 3-D cube, N = d × p × t (000 §2.20,
//! Fig 5.18), and each axis its own collectives: TP all-reduces activations inside every layer,
//! PP hands activations from stage to stage, DP all-reduces gradients once per step, EP runs two
//! all-to-alls per MoE layer. Placement follows the bandwidth hierarchy ("hierarchy-aware
//! parallelism", 000 §2.20, L2607): the most frequent, blocking traffic (TP) stays inside a host,
//! PP crosses between neighbouring hosts, DP spans the cluster (000 L37; 001 §12.8 checklist,
//! item 2).
//!
//! # Rank order
//!
//! `rank = tp + T·(dp + D·slab)`: tp varies fastest, then dp, then the pipeline slab outermost.
//! This is Megatron-LM's default order `tp-cp-ep-dp-pp` without context parallelism (ep lives
//! inside dp, see below). A launcher that numbers ranks host by host therefore puts each TP group
//! (T consecutive ranks) on one host, DP replicas next to it, and pipeline stages across hosts.
//!
//! Pipeline *stage* and *slab* differ only when [`MeshLayout`] reorders stages: slab `s` is the
//! block of ranks `[s·T·D, (s+1)·T·D)`, and `stage_order()[k]` names the slab that runs stage `k`.
//! [`MeshLayout::plan`] picks the order that minimises cross-host hops between consecutive stages
//! ([`placement::order_stages`]); on a host-contiguous launch that is the identity.
//!
//! # Expert parallelism
//!
//! As in Megatron-LM and DeepSpeed-MoE, EP does not multiply the world size: `ep` must divide
//! `dp`, and each run of `ep` consecutive DP replicas (equal pp and tp) forms an EP group whose
//! members hold different experts (000 §2.18; 001 §12.8 checklist, item 2: "EP is usually
//! carved out of the DP/TP ranks"). A rank's `ep` coordinate is `dp mod ep`. The ranks with
//! equal `ep` coordinate in one DP group hold the same experts and average their gradients
//! (expert data parallelism; no group is created for it yet).
//!
//! # Collective creation
//!
//! [`DeviceMesh::new`] is collective over the group it is given: every member must call it with
//! the same shape and `force`, after the same sequence of earlier collectives on that group. It
//! first agrees on the arguments (a mismatch is an error on every rank, not a hang), then checks
//! placement, then creates the axis groups with [`ProcessGroup::subgroup`] in a fixed order
//! (TP, DP, PP, EP; groups in [`MeshLayout::groups`] order). Every wait has the group's timeout.

pub mod placement;

use crate::error::{CommError, Result};
use crate::group::{ProcessGroup, group_id};
use std::fmt;
use std::sync::atomic::Ordering;

pub use placement::{cross_host_hops, order_stages};

/// One parallelism axis of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    /// Tensor parallelism: ranks that split each layer's matrices.
    Tp,
    /// Data parallelism: replicas that average gradients.
    Dp,
    /// Pipeline parallelism: the stages of one pipeline, in stage order.
    Pp,
    /// Expert parallelism: `ep` consecutive DP replicas that split the experts.
    Ep,
}

impl Axis {
    /// Every axis, in the order [`DeviceMesh::new`] creates their groups.
    pub const ALL: [Axis; 4] = [Axis::Tp, Axis::Dp, Axis::Pp, Axis::Ep];

    /// Position in [`Axis::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Short lower-case name (`tp`, `dp`, `pp`, `ep`).
    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
            Axis::Ep => "ep",
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Degrees of parallelism per axis; every field is at least 1 ("1 means disabled").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MeshShape {
    /// Data-parallel replicas D.
    pub dp: usize,
    /// Pipeline stages P.
    pub pp: usize,
    /// Tensor-parallel degree T (ranks per TP group).
    pub tp: usize,
    /// Expert-parallel degree E: ranks per EP group, carved out of dp (E divides D).
    pub ep: usize,
}

impl MeshShape {
    /// A shape without expert parallelism (`ep = 1`).
    pub fn new(dp: usize, pp: usize, tp: usize) -> MeshShape {
        MeshShape { dp, pp, tp, ep: 1 }
    }

    /// The degree along `axis`.
    pub fn size(&self, axis: Axis) -> usize {
        match axis {
            Axis::Tp => self.tp,
            Axis::Dp => self.dp,
            Axis::Pp => self.pp,
            Axis::Ep => self.ep,
        }
    }

    /// Ranks the shape needs, dp × pp × tp (ep does not multiply it); `None` on overflow.
    pub fn world(&self) -> Option<usize> {
        self.dp.checked_mul(self.pp)?.checked_mul(self.tp)
    }

    /// Checks that every degree is at least 1, that `dp × pp × tp == world` and that `ep`
    /// divides `dp`; the error names the fields and states the equation with its values.
    pub fn validate(&self, world: usize) -> Result<()> {
        let zero: Vec<&str> = [Axis::Dp, Axis::Pp, Axis::Tp, Axis::Ep]
            .iter()
            .filter(|&&a| self.size(a) == 0)
            .map(|a| a.name())
            .collect();
        if !zero.is_empty() {
            return Err(bad(format!(
                "{} must be at least 1 (1 disables an axis), got {self}",
                zero.join(", ")
            )));
        }
        let equation = format!("dp {} x pp {} x tp {}", self.dp, self.pp, self.tp);
        match self.world() {
            None => return Err(bad(format!("{equation} overflows"))),
            Some(n) if n != world => return Err(bad(format!("{equation} = {n} != world {world}"))),
            Some(_) => {}
        }
        if !self.dp.is_multiple_of(self.ep) {
            return Err(bad(format!(
                "ep {} must divide dp {}: expert-parallel groups are carved out of the \
                 data-parallel axis",
                self.ep, self.dp
            )));
        }
        Ok(())
    }
}

impl fmt::Display for MeshShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dp {} x pp {} x tp {} (ep {})",
            self.dp, self.pp, self.tp, self.ep
        )
    }
}

fn bad(msg: String) -> CommError {
    CommError::InvalidArgument(format!("mesh shape: {msg}"))
}

/// A rank's position in the mesh. `pp` is the pipeline stage; `ep = dp mod E` is the rank's
/// place in its EP group. Each coordinate is also the rank's index in that axis's group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MeshCoord {
    /// Data-parallel replica, `0..D`.
    pub dp: usize,
    /// Pipeline stage, `0..P`.
    pub pp: usize,
    /// Tensor-parallel rank, `0..T`.
    pub tp: usize,
    /// Expert-parallel rank, `0..E` (always `dp mod E`).
    pub ep: usize,
}

/// The pure rank arithmetic of a mesh: a validated shape and the slab that runs each stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshLayout {
    shape: MeshShape,
    /// `stage_slab[k]`: the slab of ranks that runs pipeline stage `k`.
    stage_slab: Vec<usize>,
    /// The inverse permutation: the stage each slab runs.
    slab_stage: Vec<usize>,
}

/// A layout chosen for given hosts, with the placement warnings that go with it.
#[derive(Debug, Clone)]
pub struct MeshPlan {
    /// Rank arithmetic, with stages ordered to minimise cross-host hops.
    pub layout: MeshLayout,
    /// Placement problems accepted (forced TP across hosts) or tolerated (EP across hosts).
    pub warnings: Vec<String>,
}

impl MeshLayout {
    /// The layout of `shape` over `world` ranks, stages in slab order.
    pub fn new(shape: MeshShape, world: usize) -> Result<MeshLayout> {
        shape.validate(world)?;
        Ok(MeshLayout {
            shape,
            stage_slab: (0..shape.pp).collect(),
            slab_stage: (0..shape.pp).collect(),
        })
    }

    /// The layout with stage `k` run by slab `order[k]`; `order` must be a permutation of
    /// `0..pp`.
    pub fn with_stage_order(
        shape: MeshShape,
        world: usize,
        order: Vec<usize>,
    ) -> Result<MeshLayout> {
        shape.validate(world)?;
        let mut slab_stage = vec![usize::MAX; shape.pp];
        if order.len() != shape.pp {
            return Err(CommError::InvalidArgument(format!(
                "stage order {order:?} has {} entries, pp is {}",
                order.len(),
                shape.pp
            )));
        }
        for (stage, &slab) in order.iter().enumerate() {
            match slab_stage.get_mut(slab) {
                Some(s) if *s == usize::MAX => *s = stage,
                _ => {
                    return Err(CommError::InvalidArgument(format!(
                        "stage order {order:?} is not a permutation of 0..{}",
                        shape.pp
                    )));
                }
            }
        }
        Ok(MeshLayout {
            shape,
            stage_slab: order,
            slab_stage,
        })
    }

    /// Validates `shape`, orders stages to minimise cross-host hops for ranks placed on hosts
    /// `host_of` (host index per rank; `host_names` label them in messages and may be empty),
    /// and checks placement: a TP group spanning hosts is an error unless `force`, which turns
    /// it into a warning (see [`placement::check_placement`]).
    pub fn plan(
        shape: MeshShape,
        host_of: &[usize],
        host_names: &[String],
        force: bool,
    ) -> Result<MeshPlan> {
        let order = order_stages(shape, host_of)?;
        let layout = MeshLayout::with_stage_order(shape, host_of.len(), order)?;
        let warnings = placement::check_placement(&layout, host_of, host_names, force)?;
        Ok(MeshPlan { layout, warnings })
    }

    /// The shape.
    pub fn shape(&self) -> MeshShape {
        self.shape
    }

    /// Number of ranks, dp × pp × tp.
    pub fn world(&self) -> usize {
        self.shape.dp * self.shape.pp * self.shape.tp
    }

    /// `stage_order()[k]` is the slab (block of T·D consecutive ranks) that runs stage `k`.
    pub fn stage_order(&self) -> &[usize] {
        &self.stage_slab
    }

    /// The coordinate of `rank`.
    pub fn coords(&self, rank: usize) -> Result<MeshCoord> {
        let MeshShape { dp, tp, ep, .. } = self.shape;
        if rank >= self.world() {
            return Err(CommError::InvalidArgument(format!(
                "rank {rank} is outside a mesh of {} ranks ({})",
                self.world(),
                self.shape
            )));
        }
        let d = (rank / tp) % dp;
        Ok(MeshCoord {
            dp: d,
            pp: self.slab_stage[rank / (tp * dp)],
            tp: rank % tp,
            ep: d % ep,
        })
    }

    /// The rank at `coord` (the inverse of [`coords`](Self::coords)).
    pub fn rank_of(&self, coord: MeshCoord) -> Result<usize> {
        let s = self.shape;
        let MeshCoord { dp, pp, tp, ep } = coord;
        if dp >= s.dp || pp >= s.pp || tp >= s.tp || ep >= s.ep || ep != dp % s.ep {
            return Err(CommError::InvalidArgument(format!(
                "coordinate {coord:?} is outside the mesh {s} (or ep != dp mod {})",
                s.ep
            )));
        }
        Ok(self.raw(dp, pp, tp))
    }

    /// `tp + T·(dp + D·slab(pp))`, for coordinates known to be in range.
    fn raw(&self, dp: usize, pp: usize, tp: usize) -> usize {
        tp + self.shape.tp * (dp + self.shape.dp * self.stage_slab[pp])
    }

    /// The members of `rank`'s group along `axis`, in group-rank order: entry `i` is the rank
    /// whose coordinate along `axis` is `i` (for PP: stage `i`).
    pub fn axis_ranks(&self, rank: usize, axis: Axis) -> Result<Vec<usize>> {
        let c = self.coords(rank)?;
        let s = self.shape;
        Ok(match axis {
            Axis::Tp => (0..s.tp).map(|t| self.raw(c.dp, c.pp, t)).collect(),
            Axis::Dp => (0..s.dp).map(|d| self.raw(d, c.pp, c.tp)).collect(),
            Axis::Pp => (0..s.pp).map(|p| self.raw(c.dp, p, c.tp)).collect(),
            Axis::Ep => {
                let first = c.dp - c.ep;
                (0..s.ep).map(|e| self.raw(first + e, c.pp, c.tp)).collect()
            }
        })
    }

    /// Every group along `axis`, ordered by the lowest-numbered rank with coordinate 0 on that
    /// axis (the group's leader). The groups partition the ranks.
    pub fn groups(&self, axis: Axis) -> Vec<Vec<usize>> {
        (0..self.world())
            .filter_map(|r| {
                let c = self.coords(r).ok()?;
                let lead = match axis {
                    Axis::Tp => c.tp,
                    Axis::Dp => c.dp,
                    Axis::Pp => c.pp,
                    Axis::Ep => c.ep,
                };
                if lead == 0 {
                    self.axis_ranks(r, axis).ok()
                } else {
                    None
                }
            })
            .collect()
    }
}

/// This rank's view of a mesh over a process group: its coordinate and one process group per
/// axis (a single-rank group where the degree is 1, so callers need no special case).
pub struct DeviceMesh {
    plan: MeshPlan,
    rank: usize,
    coord: MeshCoord,
    /// One group per axis, indexed by [`Axis::index`].
    groups: Vec<ProcessGroup>,
}

impl DeviceMesh {
    /// Builds (collectively, over `world`) the mesh `shape` over `world`'s ranks: agrees on the
    /// arguments, plans the layout from `world.host_of()` ([`MeshLayout::plan`]; a TP group
    /// across hosts is an error unless `force`), then creates the TP, DP, PP and EP groups.
    /// Every member of `world` must call it with the same arguments.
    pub fn new(world: &ProcessGroup, shape: MeshShape, force: bool) -> Result<DeviceMesh> {
        // Identical on every rank: all ranks issue the same collectives on `world`. Naming the
        // axis groups after it keeps two meshes built on one world from sharing store keys.
        let seq = world.inner.coll_seq.load(Ordering::SeqCst);
        let spec = format!("mesh{seq}:{shape:?}:{force}");
        let mine = group_id(&spec).to_le_bytes();
        let mut all = vec![0u8; world.size() * 8];
        world.all_gather(&mine, &mut all)?;
        if let Some(r) = all.chunks(8).position(|c| c != mine) {
            return Err(CommError::InvalidArgument(format!(
                "device mesh on '{}': rank {r} passed a different shape or force flag than \
                 rank {} ({shape}, force {force})",
                world.name(),
                world.rank()
            )));
        }
        let plan = MeshLayout::plan(shape, world.host_of(), world.host_names(), force)?;
        for w in &plan.warnings {
            tracing::warn!(
                group = world.name(),
                rank = world.rank(),
                "device mesh: {w}"
            );
        }
        let rank = world.rank();
        let coord = plan.layout.coords(rank)?;
        let mut groups = Vec::with_capacity(Axis::ALL.len());
        for axis in Axis::ALL {
            let mut member = None;
            for (i, ranks) in plan.layout.groups(axis).iter().enumerate() {
                let name = format!("mesh{seq}.{axis}{i}");
                if let Some(g) = world.subgroup(&name, ranks)? {
                    member = Some(g);
                }
            }
            groups.push(member.ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "device mesh: rank {rank} is in no {axis} group of {}",
                    plan.layout.shape()
                ))
            })?);
        }
        Ok(DeviceMesh {
            plan,
            rank,
            coord,
            groups,
        })
    }

    /// The group along `axis` that this rank belongs to; its rank is this rank's coordinate.
    pub fn group(&self, axis: Axis) -> &ProcessGroup {
        // `new` pushed one group per axis, in `Axis::ALL` order.
        &self.groups[axis.index()]
    }

    /// This rank's tensor-parallel group.
    pub fn tp(&self) -> &ProcessGroup {
        self.group(Axis::Tp)
    }

    /// This rank's data-parallel group.
    pub fn dp(&self) -> &ProcessGroup {
        self.group(Axis::Dp)
    }

    /// This rank's pipeline: group rank `k` runs stage `k`.
    pub fn pp(&self) -> &ProcessGroup {
        self.group(Axis::Pp)
    }

    /// This rank's expert-parallel group.
    pub fn ep(&self) -> &ProcessGroup {
        self.group(Axis::Ep)
    }

    /// This rank's coordinate.
    pub fn coord(&self) -> MeshCoord {
        self.coord
    }

    /// This rank's index in the group the mesh was built over.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The shape.
    pub fn shape(&self) -> MeshShape {
        self.plan.layout.shape()
    }

    /// The rank arithmetic, including the chosen stage order.
    pub fn layout(&self) -> &MeshLayout {
        &self.plan.layout
    }

    /// Placement warnings (forced TP across hosts, EP across hosts); empty when all is well.
    pub fn warnings(&self) -> &[String] {
        &self.plan.warnings
    }
}

#[cfg(test)]
mod tests;
