//! `flotilla ckpt gc` (retention and collection of crash leftovers) and `flotilla ckpt
//! interval` (Young/Daly checkpoint interval and expected loss), over `ckpt::policy`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ckpt::policy::{
    EntryKind, GcMode, GcReport, Removed, Retention, RetentionReport, apply, cluster_mtbf,
    daly_interval, expected_loss_fraction, gc, interval_steps, preview, preview_gc, young_interval,
};
use serde_json::json;

/// Options of `flotilla ckpt gc`.
#[derive(clap::Args)]
pub struct GcArgs {
    /// Checkpoint root (holding `step-<N>` directories).
    root: PathBuf,
    /// Retention: keep the K newest committed steps and delete older ones (the newest is always
    /// kept). Default 1 when only `--keep-every` is given; without either, no committed step
    /// is deleted.
    #[arg(long, value_name = "K")]
    keep_last: Option<usize>,
    /// Retention: also keep every committed step whose number is a multiple of N.
    #[arg(long, value_name = "N")]
    keep_every: Option<u64>,
    /// Collect every uncommitted leftover, also those newer than the newest committed step
    /// (which may be a save in flight): only when no job writes to ROOT.
    #[arg(long)]
    all_uncommitted: bool,
    /// Print what would be removed; remove nothing.
    #[arg(long)]
    dry_run: bool,
    /// One JSON object (the retention report, the collection report and the totals) instead of
    /// lines.
    #[arg(long)]
    json: bool,
}

/// Options of `flotilla ckpt interval`.
#[derive(clap::Args)]
#[command(allow_negative_numbers = true)]
#[command(group(
    clap::ArgGroup::new("failure_rate")
        .required(true)
        .args(["mtbf", "device_mtbf"])
))]
pub struct IntervalArgs {
    /// Foreground pause per checkpoint, C (with an asynchronous save: the pause only).
    #[arg(long, value_name = "SECS")]
    pause: f64,
    /// The job's mean time between failures, M.
    #[arg(long, value_name = "SECS")]
    mtbf: Option<f64>,
    /// Mean time between failures of one device; the job's is this / --devices.
    #[arg(long, value_name = "SECS", requires = "devices")]
    device_mtbf: Option<f64>,
    /// Number of devices any one of which stops the job on failure.
    #[arg(long, value_name = "N", requires = "device_mtbf")]
    devices: Option<u64>,
    /// Time to restart after a failure, R_f.
    #[arg(long, value_name = "SECS", default_value_t = 0.0)]
    restart: f64,
    /// Also evaluate a fixed interval of this many seconds.
    #[arg(long, value_name = "SECS")]
    every: Option<f64>,
    /// Measured seconds per training step: also print each interval in steps.
    #[arg(long, value_name = "SECS")]
    step_time: Option<f64>,
}

/// `flotilla ckpt gc`: retention (if asked for), then collection of uncommitted leftovers.
pub fn run_gc(a: GcArgs) -> Result<()> {
    let verb = if a.dry_run { "would remove" } else { "removed" };
    let mut removed = 0usize;
    let mut bytes = 0u64;
    let mut retained = None;
    if a.keep_last.is_some() || a.keep_every.is_some() {
        let retention = Retention {
            keep_last: a.keep_last.unwrap_or(1),
            keep_every: a.keep_every,
        };
        let report = if a.dry_run {
            preview(&a.root, &retention)
        } else {
            apply(&a.root, &retention)
        }
        .with_context(|| format!("retention in {}", a.root.display()))?;
        if !a.json {
            print_retention(&retention, &report, verb);
        }
        removed += report.removed.len();
        bytes = bytes.saturating_add(report.bytes_freed());
        retained =
            Some(json!({"policy": retention, "plan": report.plan, "removed": report.removed}));
    }
    let mode = if a.all_uncommitted {
        GcMode::AllUncommitted
    } else {
        GcMode::UpToNewestCommitted
    };
    let report = if a.dry_run {
        preview_gc(&a.root, mode)
    } else {
        gc(&a.root, mode)
    }
    .with_context(|| format!("collecting leftovers in {}", a.root.display()))?;
    removed += report.removed.len();
    bytes = bytes.saturating_add(report.bytes_freed());
    if a.json {
        let v = json!({"dry_run": a.dry_run, "retention": retained, "gc": report,
            "removed": removed, "bytes": bytes});
        println!("{v}");
        return Ok(());
    }
    print_gc(&report, verb);
    println!("total: {verb} {removed} directories, {bytes} bytes");
    Ok(())
}

fn print_removed(r: &Removed, verb: &str) {
    let kind = match r.kind {
        EntryKind::Committed => "committed step (retention)",
        EntryKind::Staging => "staging directory",
        EntryKind::NoMarker => "no COMMIT marker",
        EntryKind::Trash => "unfinished delete",
    };
    println!(
        "{verb:<12} {:<32} {:>14} bytes  {kind}",
        r.path.display(),
        r.bytes
    );
}

fn print_retention(retention: &Retention, report: &RetentionReport, verb: &str) {
    let every = retention
        .keep_every
        .map_or(String::new(), |n| format!(" and every multiple of {n}"));
    let keep: Vec<String> = report.plan.keep.iter().map(u64::to_string).collect();
    println!(
        "retention: keep the last {}{every}: keeping {} committed step(s) [{}], deleting {}",
        retention.keep_last,
        report.plan.keep.len(),
        keep.join(", "),
        report.plan.delete.len()
    );
    for r in &report.removed {
        print_removed(r, verb);
    }
}

fn print_gc(report: &GcReport, verb: &str) {
    for r in &report.removed {
        print_removed(r, verb);
    }
    for p in &report.in_flight {
        println!(
            "{:<12} {:<32} may be a save in flight (no committed step at or above it; \
             --all-uncommitted collects it)",
            "kept",
            p.display()
        );
    }
    for s in &report.skipped {
        println!("{:<12} {:<32} {}", "skipped", s.path.display(), s.reason);
    }
}

/// A flag's value if finite and > 0.
fn positive(flag: &str, v: f64) -> Result<f64> {
    if !(v.is_finite() && v > 0.0) {
        bail!("{flag} {v}: must be a finite number of seconds greater than zero");
    }
    Ok(v)
}

/// `flotilla ckpt interval`: Young's and Daly's intervals and the loss fraction at each.
pub fn run_interval(a: IntervalArgs) -> Result<()> {
    let c = positive("--pause", a.pause)?;
    if !(a.restart.is_finite() && a.restart >= 0.0) {
        bail!(
            "--restart {}: must be a finite number of seconds, zero or more",
            a.restart
        );
    }
    let m = match (a.mtbf, a.device_mtbf, a.devices) {
        (Some(m), _, _) => {
            let m = positive("--mtbf", m)?;
            println!("MTBF M:       {m} s ({:.2} h)", m / 3600.0);
            m
        }
        (None, Some(d), Some(n)) => {
            let d = positive("--device-mtbf", d)?;
            if n == 0 {
                bail!("--devices 0: must be at least 1");
            }
            let m = cluster_mtbf(d, n)?;
            println!(
                "MTBF M:       {m:.2} s ({:.2} h) = {d} s per device / {n} devices \
                 (004 line 365: independent failures assumed)",
                m / 3600.0
            );
            m
        }
        _ => bail!("give --mtbf, or --device-mtbf with --devices"),
    };
    let step_time = a
        .step_time
        .map(|s| positive("--step-time", s))
        .transpose()?;
    println!("pause C:      {c} s (foreground)");
    println!("restart R_f:  {} s", a.restart);
    let mut rows = vec![
        ("young", young_interval(c, m)?, "004 eq. 28.24: sqrt(2CM)"),
        ("daly", daly_interval(c, m)?, "Daly 2006, higher order"),
    ];
    if let Some(every) = a.every {
        rows.push(("every", positive("--every", every)?, "as given"));
    }
    for (name, tau, source) in rows {
        let w = expected_loss_fraction(tau, c, m, a.restart)?;
        let steps = match step_time {
            Some(s) => format!(", every {} steps", interval_steps(tau, s)?),
            None => String::new(),
        };
        println!(
            "{:<13} interval {tau:.2} s ({:.2} min){steps}, expected loss {:.3}% ({source})",
            format!("{name}:"),
            tau / 60.0,
            100.0 * w
        );
    }
    println!("expected loss is 004 eq. 28.23: C/tau + tau/(2M) + R_f/M");
    Ok(())
}
