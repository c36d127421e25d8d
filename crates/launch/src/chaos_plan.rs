//! The agent's chaos plan for each generation: node 0 (the leader) resolves the generation's
//! faults from the plan and the seed, says them and publishes them in the store; the other
//! nodes take those. Under `--ft` every fault of the plan is resolved at once.
use std::time::Duration;

use crate::agent::{AgentConfig, say};
use crate::chaos::{self, Fault};
use crate::error::Result;
use comm::store::StoreClient;

/// Generation `g`'s faults ([`Chaos::resolve_in`], the failed generations having reached step
/// `seen`, on the nodes `members`): node 0 resolves them, says so and publishes them; the other
/// nodes take those (their own seeds may differ), waiting for them at most the admission
/// timeout. A later generation's fault that no longer fits its (smaller) world is skipped.
pub(crate) fn chaos_plan(
    cfg: &AgentConfig,
    store: &StoreClient,
    leads: bool,
    g: u64,
    seen: u64,
    members: &[usize],
    detection: Duration,
) -> Result<Vec<Fault>> {
    let key = format!("launch/g{g}/chaos");
    if leads {
        let faults = match cfg
            .chaos
            .resolve_in(g, seen, &draw(cfg, members, detection))
        {
            Err(e) if g > 0 => {
                say(cfg, format!("chaos: generation {g}'s faults skipped: {e}"));
                Vec::new()
            }
            r => {
                let faults = r?;
                let skipped = cfg.chaos.episode(g).len() - faults.len();
                if skipped > 0 {
                    say(
                        cfg,
                        format!(
                            "chaos: {skipped} fault(s) of generation {g} skipped: no step left \
                             after {seen}"
                        ),
                    );
                }
                faults
            }
        };
        for f in &faults {
            let who = match f.kind {
                chaos::FaultKind::Partition(_) => format!("node {}", f.rank),
                _ => format!("rank {}", f.rank),
            };
            let what = match f.kind {
                chaos::FaultKind::Kill => "SIGKILL itself".to_string(),
                chaos::FaultKind::Hang => "SIGSTOP itself".to_string(),
                chaos::FaultKind::Stall => "stop progressing".to_string(),
                chaos::FaultKind::Slow(_) => format!("become {}x slower", f.kind.factor()),
                chaos::FaultKind::Partition(_) => format!(
                    "be cut off the network for {} s",
                    f.partition().unwrap_or_default().as_secs()
                ),
            };
            say(
                cfg,
                format!(
                    "chaos: {f} (seed {}): {who} will {what} after step {} in generation {g}",
                    cfg.chaos_seed, f.step
                ),
            );
        }
        let text = if faults.is_empty() {
            "none".to_string()
        } else {
            Fault::list(&faults)
        };
        store.set(&key, text.as_bytes())?;
        return Ok(faults);
    }
    let text = store.wait_one(&key, cfg.admission_timeout)?;
    match String::from_utf8_lossy(&text).as_ref() {
        "none" => Ok(Vec::new()),
        f => Fault::parse_list(f),
    }
}

/// What the chaos plan's random choices are drawn against: the job's seed and steps, the
/// generation's `members`, a partition's default length from the `detection` time.
fn draw<'a>(cfg: &AgentConfig, members: &'a [usize], detection: Duration) -> chaos::Draw<'a> {
    chaos::Draw {
        seed: cfg.chaos_seed,
        steps: cfg.steps,
        nproc: cfg.nproc,
        members,
        partition_default: crate::partition::default_duration(detection),
    }
}

/// Under `--ft`, every fault of the chaos plan at once (resolved for the generation's
/// `members`), said and handed to every worker ([`crate::ft`]).
pub(crate) fn ft_chaos(
    cfg: &AgentConfig,
    leads: bool,
    members: &[usize],
    detection: Duration,
) -> Result<Vec<Fault>> {
    let faults = crate::ft::resolve_all(&cfg.chaos, &draw(cfg, members, detection))?;
    if leads {
        for f in &faults {
            say(
                cfg,
                format!(
                    "chaos: {f} (seed {}): rank {} strikes after step {} (per-step fault tolerance)",
                    cfg.chaos_seed, f.rank, f.step
                ),
            );
        }
    }
    Ok(faults)
}
