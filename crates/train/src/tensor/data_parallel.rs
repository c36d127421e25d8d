//! The agreement a DP x TP grid makes before training (000 "混合并行", §2.20): every rank
//! tells its peers its setup (tp degree and rank, dp degree and rank, `grad_accum`, the
//! training config's hash) over both its groups, so ranks that would pair unlike buffers in
//! the replicas' sums fail together with an error naming `data_parallel` and the equation
//! `dp x tp = world`, instead of hanging or summing nonsense.
use comm::ReduceOp;
use comm::group::{ProcessGroup, group_id};

use super::trainer::refuse;
use crate::checkpoint::config_hash;
use crate::config::TrainConfig;
use crate::error::Result;

/// What a rank tells its peers before training, one value per name (see [`setup`]).
const SETUP: [&str; 6] = ["tp", "tp rank", "dp", "dp rank", "grad_accum", "config"];
/// The index in [`SETUP`] of the tp rank, the one field that differs inside a tp group.
const TP_RANK: usize = 1;
/// The index in [`SETUP`] of the dp rank, the one field that differs inside a dp group.
const DP_RANK: usize = 3;

/// This rank's setup as [`SETUP`] names it.
fn setup(cfg: &TrainConfig, tp: &ProcessGroup, dp: &ProcessGroup) -> [i64; 6] {
    let config = group_id(&config_hash(cfg));
    let small = |x: usize| i64::try_from(x).unwrap_or(i64::MAX);
    [
        small(tp.size()),
        small(tp.rank()),
        small(dp.size()),
        small(dp.rank()),
        small(cfg.grad_accum),
        i64::from_le_bytes(config.to_le_bytes()),
    ]
}

/// `v`, the value of [`SETUP`] field `field`, as an error message shows it.
fn show(field: usize, v: i64) -> String {
    match SETUP[field] {
        "config" => format!(
            "training config {:016x}",
            u64::from_le_bytes(v.to_le_bytes())
        ),
        name => format!("{name} {v}"),
    }
}

/// Gathers every member's setup over `group` (a collective) and describes the first member
/// that differs from `mine` in a field other than `own` (the one expected to differ there).
fn disagreement(group: &ProcessGroup, mine: &[i64; 6], own: usize) -> Result<Option<String>> {
    let mut all = vec![0i64; mine.len() * group.size()];
    group.all_gather(mine, &mut all)?;
    for (member, theirs) in all.chunks(mine.len()).enumerate() {
        let differs = (0..mine.len()).find(|&f| f != own && theirs[f] != mine[f]);
        if let Some(f) = differs {
            return Ok(Some(format!(
                "member {member} of this rank's {} group runs {} where member {} runs {}",
                if own == TP_RANK { "tp" } else { "dp" },
                show(f, theirs[f]),
                group.rank(),
                show(f, mine[f]),
            )));
        }
    }
    Ok(None)
}

/// Checks (collectively over `tp` and `dp`) that the ranks form a `dp x tp` grid of one
/// config: inside a tp group the same replica (dp rank) and degrees, inside a dp group the
/// same tp rank and degrees; every rank fails when any rank of the world it can see does.
pub(super) fn agree_across_replicas(
    cfg: &TrainConfig,
    tp: &ProcessGroup,
    dp: &ProcessGroup,
) -> Result<()> {
    let mine = setup(cfg, tp, dp);
    // Both gathers run before any verdict, so every peer's collectives pair up.
    let over_tp = disagreement(tp, &mine, TP_RANK)?;
    let over_dp = disagreement(dp, &mine, DP_RANK)?;
    let mine_ok = over_tp.is_none() && over_dp.is_none();
    let failed = failures(tp, Some(dp), mine_ok)?;
    let why = match over_tp.or(over_dp) {
        Some(why) => why,
        None if failed > 0 => format!("{failed} rank(s) of the world found a mismatch"),
        None => return Ok(()),
    };
    let (d, t) = (dp.size(), tp.size());
    Err(refuse(
        "data_parallel",
        &format!("dp {d} x tp {t}"),
        &format!(
            "{why}: every replica must be a tp-{t} group of the same training config and \
             grad_accum, each dp group one tp rank of every replica (dp x tp = world: this \
             rank's groups make dp {d} x tp {t} = {} ranks)",
            d * t
        ),
    ))
}

/// How many ranks of the `dp x tp` world passed `ok = false`: the flags summed over `tp`,
/// then those sums over `dp`, so on a `dp x tp` grid every rank gets the world's count. A
/// collective over both groups (exact: small integers).
pub(crate) fn failures(tp: &ProcessGroup, dp: Option<&ProcessGroup>, ok: bool) -> Result<i64> {
    let mut n = [i64::from(!ok)];
    tp.all_reduce(&mut n, ReduceOp::Sum)?;
    if let Some(dp) = dp {
        dp.all_reduce(&mut n, ReduceOp::Sum)?;
    }
    Ok(n[0])
}
